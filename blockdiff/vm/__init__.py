"""Sandbox VMs: the image builder, QEMU (launch, QMP, NBD), the link to the
guest's daemon, and the sandbox whose disk is checkpointed into a store."""

from blockdiff.vm.sandbox import Sandbox

__all__ = ["Sandbox"]
