"""Flash checkpoints: state saved to shared memory owned by the agent in
milliseconds, persisted asynchronously, saved on failure, restored from memory
after a restart; framework adapters for DDP, FSDP and HuggingFace Trainer.
"""
