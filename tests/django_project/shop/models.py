from django.db import models


class Order(models.Model):
    email = models.EmailField()
    confirmed = models.BooleanField(default=False)


class Run(models.Model):
    """One row per execution of `shop.tasks.record`: what ran, in which process."""

    name = models.CharField(max_length=100)
    pid = models.IntegerField()
