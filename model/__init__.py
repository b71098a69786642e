from model.registry import create_model, list_models, register_model
from model.vit import VisionTransformer

__all__ = ["VisionTransformer", "create_model", "list_models", "register_model"]
