"""Counter backends behind one interface (see ``base.CounterBackend``)."""
