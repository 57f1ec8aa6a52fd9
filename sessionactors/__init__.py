"""sessionactors: many concurrent, durable LLM conversations as trio actors."""

import logging as _logging

from ._agent import Agent as Agent
from ._agent import Compaction as Compaction
from ._codec import MAX_METADATA_BYTES as MAX_METADATA_BYTES
from ._codec import dump_snapshot as dump_snapshot
from ._codec import load_snapshot as load_snapshot
from ._errors import AgentNotFoundError as AgentNotFoundError
from ._errors import EventsExpiredError as EventsExpiredError
from ._errors import FencedOutError as FencedOutError
from ._errors import IdempotencyKeyReusedError as IdempotencyKeyReusedError
from ._errors import InvalidHistoryError as InvalidHistoryError
from ._errors import InvalidSessionNameError as InvalidSessionNameError
from ._errors import LeaseHeldError as LeaseHeldError
from ._errors import MailboxFullError as MailboxFullError
from ._errors import MaxStepsError as MaxStepsError
from ._errors import MessageNotFoundError as MessageNotFoundError
from ._errors import ModelError as ModelError
from ._errors import NothingToRetryError as NothingToRetryError
from ._errors import ReplyRemovedError as ReplyRemovedError
from ._errors import ReviewNotFoundError as ReviewNotFoundError
from ._errors import ReviewResolvedError as ReviewResolvedError
from ._errors import SessionActorsError as SessionActorsError
from ._errors import SessionBusyError as SessionBusyError
from ._errors import SessionCrashedError as SessionCrashedError
from ._errors import SessionExistsError as SessionExistsError
from ._errors import SessionNotFoundError as SessionNotFoundError
from ._errors import SessionStoppedError as SessionStoppedError
from ._errors import SnapshotCorruptError as SnapshotCorruptError
from ._errors import SnapshotError as SnapshotError
from ._errors import SnapshotVersionError as SnapshotVersionError
from ._errors import StoreConfigurationError as StoreConfigurationError
from ._errors import StoreError as StoreError
from ._errors import StoreNotDurableError as StoreNotDurableError
from ._errors import StoreNotReplicatedError as StoreNotReplicatedError
from ._errors import SubscriberLaggedError as SubscriberLaggedError
from ._errors import TurnCancelledError as TurnCancelledError
from ._errors import TurnFailedError as TurnFailedError
from ._errors import TurnNotFoundError as TurnNotFoundError
from ._errors import TurnTimeoutError as TurnTimeoutError
from ._errors import WorkerUnreachableError as WorkerUnreachableError
from ._events import Delta as Delta
from ._events import Event as Event
from ._events import HistoryEdited as HistoryEdited
from ._events import MessageAdded as MessageAdded
from ._events import MetadataChanged as MetadataChanged
from ._events import ReviewRequested as ReviewRequested
from ._events import ReviewResolved as ReviewResolved
from ._events import StatusChanged as StatusChanged
from ._events import ToolCallStarted as ToolCallStarted
from ._events import ToolResult as ToolResult
from ._events import TurnCancelled as TurnCancelled
from ._events import TurnFailed as TurnFailed
from ._events import TurnFinished as TurnFinished
from ._events import TurnStarted as TurnStarted
from ._model import FinishChunk as FinishChunk
from ._model import Model as Model
from ._model import ModelChunk as ModelChunk
from ._model import ModelRequest as ModelRequest
from ._model import TextChunk as TextChunk
from ._model import ToolCallChunk as ToolCallChunk
from ._model import ToolSpec as ToolSpec
from ._model import UsageChunk as UsageChunk
from ._reading import read_session as read_session
from ._records import CompletedTurn as CompletedTurn
from ._records import Message as Message
from ._records import OpenTurn as OpenTurn
from ._records import ReviewRequest as ReviewRequest
from ._records import Role as Role
from ._records import SessionInfo as SessionInfo
from ._records import SessionState as SessionState
from ._records import Status as Status
from ._records import ToolCall as ToolCall
from ._records import TurnOutcome as TurnOutcome
from ._records import TurnRecord as TurnRecord
from ._records import TurnStatus as TurnStatus
from ._records import Usage as Usage
from ._ref import SessionRef as SessionRef
from ._ref import Turn as Turn
from ._registry import Registry as Registry
from ._registry import RegistryStatistics as RegistryStatistics
from ._registry import open_registry as open_registry
from ._requests import Reply as Reply
from ._telemetry import ModelCallTrace as ModelCallTrace
from ._telemetry import Telemetry as Telemetry
from ._telemetry import ToolCallTrace as ToolCallTrace
from ._telemetry import TurnTrace as TurnTrace
from ._tools import Tool as Tool
from ._tools import ToolContext as ToolContext
from ._tools import ToolOutcome as ToolOutcome
from ._tools import tool as tool
from .stores._memory import MemoryStore as MemoryStore
from .stores._sqlite import SQLiteStore as SQLiteStore

# The library logs under "sessionactors"; the application decides where it goes.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [  # noqa: RUF022 (sorted plainly, as tests/test_public_api.py checks)
    "Agent",
    "AgentNotFoundError",
    "Compaction",
    "CompletedTurn",
    "Delta",
    "Event",
    "EventsExpiredError",
    "FencedOutError",
    "FinishChunk",
    "HistoryEdited",
    "IdempotencyKeyReusedError",
    "InvalidHistoryError",
    "InvalidSessionNameError",
    "LeaseHeldError",
    "MAX_METADATA_BYTES",
    "MailboxFullError",
    "MaxStepsError",
    "MemoryStore",
    "Message",
    "MessageAdded",
    "MessageNotFoundError",
    "MetadataChanged",
    "Model",
    "ModelCallTrace",
    "ModelChunk",
    "ModelError",
    "ModelRequest",
    "NothingToRetryError",
    "OpenTurn",
    "Registry",
    "RegistryStatistics",
    "Reply",
    "ReplyRemovedError",
    "ReviewNotFoundError",
    "ReviewRequest",
    "ReviewRequested",
    "ReviewResolved",
    "ReviewResolvedError",
    "Role",
    "SQLiteStore",
    "SessionActorsError",
    "SessionBusyError",
    "SessionCrashedError",
    "SessionExistsError",
    "SessionInfo",
    "SessionNotFoundError",
    "SessionRef",
    "SessionState",
    "SessionStoppedError",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotVersionError",
    "Status",
    "StatusChanged",
    "StoreConfigurationError",
    "StoreError",
    "StoreNotDurableError",
    "StoreNotReplicatedError",
    "SubscriberLaggedError",
    "Telemetry",
    "TextChunk",
    "Tool",
    "ToolCall",
    "ToolCallChunk",
    "ToolCallStarted",
    "ToolCallTrace",
    "ToolContext",
    "ToolOutcome",
    "ToolResult",
    "ToolSpec",
    "Turn",
    "TurnCancelled",
    "TurnCancelledError",
    "TurnFailed",
    "TurnFailedError",
    "TurnFinished",
    "TurnNotFoundError",
    "TurnOutcome",
    "TurnRecord",
    "TurnStarted",
    "TurnStatus",
    "TurnTimeoutError",
    "TurnTrace",
    "Usage",
    "UsageChunk",
    "WorkerUnreachableError",
    "dump_snapshot",
    "load_snapshot",
    "open_registry",
    "read_session",
    "tool",
]
