"""HTTP entry points: the OpenAI-compatible server (`openai_server.build_app`)."""
