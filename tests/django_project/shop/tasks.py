"""The project's tasks: Django's @task, run by fastjobs' workers."""

import os

from django.tasks import task

from .models import Order, Run


@task
def add(a, b):
    return a + b


class OutOfStock(Exception):
    pass


@task
def fail(message):
    raise ValueError(message)


@task
def refuse(item):
    raise OutOfStock(item)


@task(takes_context=True)
def whoami(context, note):
    return {"id": context.task_result.id, "attempt": context.attempt, "note": note}


@task
def record(name):
    Run.objects.create(name=name, pid=os.getpid())
    return name


@task(queue_name="emails", priority=10)
def confirm(order_id):
    Order.objects.filter(id=order_id).update(confirmed=True)
    return order_id


@task
async def double(x):
    return 2 * x
