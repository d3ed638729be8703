"""Models: the registry of backbones (local checkpoints, random configs, Hub ids) and how they are loaded."""
