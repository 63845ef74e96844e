"""Adapters that plug fastkv into serving engines.

`fastkv.integrations.fastdeploy` replaces FastDeploy's cache manager v1 (scheduler
side) and cache controller (worker side); `fastkv.channel` carries the workers'
transfer results back to the scheduler. Importing this package imports neither
the engines nor paddle.
"""
