"""The control plane: REST API, persistent store, reconciler loop and executors.

This package never imports torch: workloads are processes it launches and watches.
"""
