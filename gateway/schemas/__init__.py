"""What crosses the HTTP boundary, as pydantic models: request bodies (inference, admin,
structured outputs, their bounded field types on one strict base), the response models
the OpenAPI document is built from, and the OpenAI-shaped bodies the routes send.
"""
