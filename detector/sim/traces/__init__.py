"""Sample traces in the COS 418 formats, shipped with stablewatch (``stablewatch simulate``)."""
