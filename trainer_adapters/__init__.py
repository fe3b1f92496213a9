"""Trainer adapters: the few lines a trainer adds to get corral's sandboxes and rollouts.

- `common`: tools mode (`ToolsModeRollouts`: the trainer generates, corral runs the rest) and
  service mode (`connect_service`: the daemon's RolloutService generates from the trainer's
  servers), shared by every adapter.
- `verl`, `miles`, `tunix`: each trainer's types and hooks (imported on demand: each needs its
  trainer package).
"""
