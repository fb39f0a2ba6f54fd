"""What a process tells about itself: metrics (defined once) and their endpoint, RPC meters,
traces, logs and build info.
"""
