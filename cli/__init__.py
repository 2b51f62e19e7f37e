"""The front door: the ``stablewatch`` command, one module per command, the live demo and renderings.

It sits on top of the house: it imports the detector, the pipeline and the examples, and nothing
imports it. :mod:`.main` parses the top level and hands each command to its module, which adds its
parser (``add_parser``) and runs it (``run``); :mod:`.arguments` holds the argument types they
share, :mod:`.query` what the commands that ask a running detector share, :mod:`.client` the
query API's client, :mod:`.render` the terminal output, :mod:`.live_demo` the demo's systems.
"""
