"""mslk.core: what every MSLK domain shares.

- `arch`: every hardware question (vendor, compute capability, SM count, FP8 flavour).
- `formats`: the scale formats that quantizers produce and GEMMs validate.
- `registry`: ops, their backends, dispatch and the NotSupportedError text.
- `env`: every MSLK_* environment variable.
- `domains`: discovery of the installed domain packages.
- `testing`, `bench`, `cli`: test helpers, benchmark runner, the `mslk` command.
"""
