"""What the cluster gives the job: its layout (``env``: which launcher started us, ranks, nodes, the
rendezvous address) and its stop requests (``stop``: the signals and the STOP-file protocol every launcher
shares)."""
