"""Agent code: the API authored agents implement (api), the deterministic fixture agent of tests
and the demo, and the OpenAI-compatible model adapter.
"""
