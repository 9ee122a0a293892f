"""pd_buffer: one registered region split into fixed-size pages, reserved with leases."""
