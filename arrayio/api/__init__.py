"""The public functions and their helpers: saving, loading and the lazy reader, the
asynchronous front doors, and tuning. Everything public here is re-exported by
:mod:`arrayio`, which is where users import it from."""
