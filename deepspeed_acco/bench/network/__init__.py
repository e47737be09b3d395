"""The emulated network: nodes and shaped links, jobs started across them, a latency model, a one-process link."""
