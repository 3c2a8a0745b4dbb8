"""Multi-step jobs above the three libraries, as functions a notebook or a script can call:
``profile`` (measure this machine into a calibration) and ``validate`` (run plans, compare with
their predictions, refit). The CLI modules only parse flags and print what these return."""
