"""The round loop and what it reads and writes: settings, Step records, verification, sampling, k
policy, costs, metrics, text. Imports nothing else of the app."""
