"""Agent checkpoints: threads of steps whose state, messages, environment,
journal of tool calls and disk snapshot are one checkpoint, with approvals,
forks, time travel and diffs; sealing of what they hold; a LangGraph
checkpointer (:mod:`blockdiff.agent.langgraph`, an optional dependency, not
imported here)."""

from blockdiff.agent.agent import (
    NOT_APPLIED,
    Agent,
    AgentDB,
    Step,
    Tool,
    fork_thread,
    rewind_thread,
)
from blockdiff.agent.diff import CheckpointDiff, diff_checkpoints
from blockdiff.agent.disks import ImageDisk
from blockdiff.agent.model import Environment

__all__ = ["NOT_APPLIED", "Agent", "AgentDB", "CheckpointDiff", "Environment", "ImageDisk",
           "Step", "Tool", "diff_checkpoints", "fork_thread", "rewind_thread"]
