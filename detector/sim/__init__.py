"""The deterministic simulator and the COS 418 trace formats it reads and writes."""
