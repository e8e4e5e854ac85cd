"""Agent checkpoints: threads of steps whose state, messages, journal of tool
calls and disk snapshot are one checkpoint, with approvals, forks and time
travel; sealing of what they hold; a LangGraph checkpointer
(:mod:`blockdiff.agent.langgraph`, an optional dependency, not imported here)."""

from blockdiff.agent.agent import Agent, AgentDB, Step, Tool, fork_thread, rewind_thread
from blockdiff.agent.disks import ImageDisk

__all__ = ["Agent", "AgentDB", "ImageDisk", "Step", "Tool", "fork_thread", "rewind_thread"]
