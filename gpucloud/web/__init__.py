"""What every HTTP server of gpucloud shares: problem+json errors (`problems`)."""
