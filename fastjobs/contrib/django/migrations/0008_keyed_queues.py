"""fastjobs' schema up to its migration 012, queues marked keyed (fastjobs.contrib.django.schema)."""

from django.db import migrations

from fastjobs.contrib.django.schema import migrate_to


class Migration(migrations.Migration):  # type: ignore[misc]  # django has no type information
    atomic = False  # fastjobs' steps run in their own transactions, index builds outside any
    dependencies = [("fastjobs", "0007_key_groups")]
    operations = [migrations.RunPython(migrate_to(12), migrations.RunPython.noop, elidable=False)]
