"""A handler module whose import fails (for the ``qm receive`` error test)."""

raise RuntimeError("this module cannot be imported")
