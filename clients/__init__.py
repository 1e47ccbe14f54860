"""fedagg ClientApp (``clients.app:app``): a site, its local workers and upward encoders."""
