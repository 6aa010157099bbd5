"""The project's own tests, run by `manage.py test`: Django's test runner and fastjobs' testing kit.

A TransactionTestCase, because the kit drains on a connection of its own,
which sees committed jobs only (a TestCase never commits).
"""

from django.tasks import TaskResultStatus, default_task_backend
from django.test import TransactionTestCase

from .models import Order
from .tasks import add, confirm


class OrderTests(TransactionTestCase):
    def test_an_order_is_confirmed_by_its_task(self):
        with default_task_backend.testing() as kit:
            response = self.client.post("/orders", {"email": "a@example.com"})
            self.assertEqual(response.status_code, 200)
            order = response.json()["order"]
            kit.assert_enqueued(confirm.module_path, args={"args": [order], "kwargs": {}}, queue="emails")
            self.assertFalse(Order.objects.get(id=order).confirmed)
            kit.drain()
        self.assertTrue(Order.objects.get(id=order).confirmed)

    def test_a_result_through_the_kit(self):
        with default_task_backend.testing() as kit:
            result = add.enqueue(20, 22)
            kit.drain()
        result.refresh()
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(result.return_value, 42)
