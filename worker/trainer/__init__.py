"""Train Rodan's patchwise selectional auto-encoders ("Calvo" models) with TensorFlow 2 / Keras 3.

This package only trains: it never talks to RabbitMQ or Rodan (the worker around it
downloads the inputs and sends the models back).
"""

from worker.trainer.errors import TrainingInputError
from worker.trainer.page import Page, load_page
from worker.trainer.settings import TrainSettings
from worker.trainer.train import train_page

__all__ = ["Page", "TrainSettings", "TrainingInputError", "load_page", "train_page"]
