"""Test harness for stablewatch and for the services that embed its agent: real pieces, run the way
a test or a benchmark needs them.

* :mod:`.detector`: ``Running``, a real detector on its own event-loop thread.
* :mod:`.tcp_proxy`: ``TcpProxy``, a TCP proxy that breaks, pauses, throttles or refuses connections.
* :mod:`.token_nodes`: ``Node``, ``connect_all``, ``wait_quiet``: token-bank services embedding the
  agent (:mod:`.token_node`), each its own OS process, driven over stdin and stdout.

Nothing in the agents, the detector, the pipeline or the examples imports this package.
"""
