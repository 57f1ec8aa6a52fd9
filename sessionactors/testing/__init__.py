"""Test helpers: fake models and the store conformance suite."""

from ._check_store import check_store as check_store
from ._models import EchoModel as EchoModel
from ._models import Scripted as Scripted
from ._models import ScriptedModel as ScriptedModel
from ._models import ScriptExhaustedError as ScriptExhaustedError

__all__ = ["EchoModel", "ScriptExhaustedError", "Scripted", "ScriptedModel", "check_store"]
