"""What crosses the wire between devices: the dtypes a policy chooses for it, and
the report that reads them back out of the partitioned program.

How it works and how to extend it: README.md in this folder. The public names
come from the modules themselves (``jaxamp/__init__.py`` imports them there):
this ``__init__`` imports nothing, because ``jaxamp._policy`` reads
``_warnings`` and a re-exporting ``__init__`` would first run ``_gather``, which
reads ``jaxamp._policy``.
"""
