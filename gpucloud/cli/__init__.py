"""`gpucloud`: the command line (`main.app`), one module per command group."""
