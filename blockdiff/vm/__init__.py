"""Sandbox VMs: the image builder, the registry of a store's VMs, QEMU (its
command line and QMP; the machine that runs one VM), the link to the guest
daemon, and the sandbox whose disk is checkpointed into a store."""

from blockdiff.vm.sandbox import Sandbox

__all__ = ["Sandbox"]
