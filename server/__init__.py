"""fedagg ServerApp (``server.app:app``), its round loop and checkpoints."""
