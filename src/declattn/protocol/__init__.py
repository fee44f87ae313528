"""The DA protocol: context -> chunks -> prompt + layout; output text -> declarations.

Nothing here imports torch: any engine can use it.
"""
