"""Views that enqueue in their own transaction: the job exists iff the order does."""

from django.db import transaction
from django.http import Http404, JsonResponse
from django.tasks import default_task_backend
from django.tasks.exceptions import TaskResultDoesNotExist
from django.views.decorators.csrf import csrf_exempt

from .models import Order
from .tasks import confirm


@csrf_exempt
def place_order(request):
    with transaction.atomic():
        order = Order.objects.create(email=request.POST["email"])
        result = confirm.enqueue(order.id)
        if request.POST.get("fail"):
            raise RuntimeError("the payment failed")  # rolls back the order and its job
    return JsonResponse({"order": order.id, "task": result.id})


def task_result(request, result_id):
    try:
        result = default_task_backend.get_result(result_id)
    except TaskResultDoesNotExist:
        raise Http404(result_id) from None
    value = result.return_value if result.status == "SUCCESSFUL" else None
    return JsonResponse({"status": result.status, "value": value})
