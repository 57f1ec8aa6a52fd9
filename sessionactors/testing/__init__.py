"""Test helpers: fake models, stores that fail or break on purpose, the store conformance suite.

A plug-in: it imports the core, and nothing in the core imports it.
"""

from ._check_store import check_store as check_store
from ._crash import crash as crash
from ._exports import export_document as export_document
from ._journal import journal_events as journal_events
from ._models import EchoModel as EchoModel
from ._models import Scripted as Scripted
from ._models import ScriptedModel as ScriptedModel
from ._models import ScriptExhaustedError as ScriptExhaustedError
from ._stores import FaultyStore as FaultyStore
from ._stores import FlawedStore as FlawedStore
from ._stores import Gate as Gate

__all__ = [
    "EchoModel",
    "FaultyStore",
    "FlawedStore",
    "Gate",
    "ScriptExhaustedError",
    "Scripted",
    "ScriptedModel",
    "check_store",
    "crash",
    "export_document",
    "journal_events",
]
