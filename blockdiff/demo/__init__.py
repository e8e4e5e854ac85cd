"""The main job (`blockdiff demo`: an agent session on a scratch filesystem,
every step checkpointed, restored and compared) and the scratch filesystems
it and the tests make; nothing in the runtime packages imports this."""
