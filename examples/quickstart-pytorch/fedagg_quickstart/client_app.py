"""The ClientApp: fedagg runs the task with every site feature (workers, compression, masking)."""

from clients import make_client_app
from fedagg_quickstart.task import TASK

app = make_client_app(TASK)
