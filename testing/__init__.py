"""Test harness for stablewatch and for the services that embed its agent: real pieces, run the way
a test or a benchmark needs them.

* :mod:`.detector`: ``Running``, a real detector on its own event-loop thread.
* :mod:`.tcp_proxy`: ``TcpProxy``, a TCP proxy that breaks, pauses, throttles or refuses connections.
* :mod:`.detector_process`: ``DetectorProcess``, ``stablewatch detector`` as an OS process.
* :mod:`.json_process`: ``JsonProcess``, one of the services below as an OS process, driven by
  JSON lines over stdin and stdout; ``LineReader``, a pipe's lines read on a thread.
* :mod:`.token_nodes`: ``Node``, ``connect_all``, ``wait_quiet``: token-bank services embedding the
  agent (:mod:`.token_node`).
* :mod:`.deadlock_node`: ``DeadlockProcess``: services that deadlock on purpose, for breaking.

Nothing in the agents, the detector, the pipeline or the examples imports this package.
"""
