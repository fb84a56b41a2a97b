"""Deployment: model repositories built from models/ (repo, llmapi_repo), and tritonserver run on them
(tritonserver, supervisor, frontend: the OpenAI front started beside it)."""
