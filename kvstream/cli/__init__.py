"""The ``kvstream`` command line. The only place that starts an event loop."""
