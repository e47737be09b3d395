"""The overlapped ZeRO-1 engine: configuration, communication pipeline, schedules, checkpoints."""
