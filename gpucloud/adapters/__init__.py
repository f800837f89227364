"""One client per outside system, each behind a small interface; `gpucloud.bootstrap` picks them."""
