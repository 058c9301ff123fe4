"""OpenAI-compatible routes."""
from fastapi import APIRouter

router = APIRouter()
