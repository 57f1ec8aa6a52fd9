"""sessionactors over HTTP: an ASGI gateway (JSON, server-sent events, WebSocket) and a chat page.

``create_app(...)`` makes an ASGI 3 application that runs under hypercorn's
trio worker and under uvicorn; ``python -m sessionactors serve`` serves it.
Needs the ``http`` extra: Starlette and anyio, which importing this package
needs, and hypercorn, which only ``serve`` (and ``python -m sessionactors serve``)
imports, so that an app served by uvicorn needs no hypercorn.
"""

from ._app import SessionsApp as SessionsApp
from ._app import create_app as create_app
from ._json import event_to_json as event_to_json
from ._serve import serve as serve

__all__ = ["SessionsApp", "create_app", "event_to_json", "serve"]
