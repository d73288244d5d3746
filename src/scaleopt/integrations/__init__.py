"""scaleopt in other trainers: :mod:`scaleopt.integrations.torchtitan`. Each module imports
without its trainer installed."""
