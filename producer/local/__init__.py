"""The local stack: the whole Chorus path on one machine, with nothing to install.

- ``standins``: the Kafka and S3 stand-ins, each in a helper process;
- ``config``, ``processes``, ``ready``, ``stack``: ``EmbeddedStack``, which starts the stand-ins and real
  ``chorus scheduler`` / ``chorus worker`` processes pointed at them, waits until they are ready, and stops them;
- ``demo_*``: ``chorus demo``, a stream of similar prompts through that stack.

The services never import this package: only ``chorus demo`` and the tests use it.
"""
