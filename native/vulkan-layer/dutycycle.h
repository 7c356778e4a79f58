/* A slice's share of GPU time: a cooperative duty cycle on vkQueueSubmit.
 *
 *   GPUPPETTI_VK_COMPUTE  comma-separated, one per slice of GPUPPETTI_VK_SLICES and in its order: the slice's share
 *                         of its GPU's time in thousandths (1 to 1000; 1000 is not throttled)
 *
 * After each batch the layer submits a fence of its own; a thread per device waits for it, takes the batch's GPU
 * time as the time from its start (its submit, or the end of the batch before it on that queue) to its end, and
 * pushes the slice's next allowed submit out by that time divided by the share. A submit waits for that time; it is
 * never refused, and work already queued is never stopped: there is no preemption. The time is kept in the slice's
 * accounting file, so every process of a container (and every container of a DRA claim) shares one duty cycle.
 *
 * Where the share is not held exactly: one batch is charged at most 10 s of GPU time (a batch seen to end late,
 * after a SIGSTOP, is not a debt); past 64 batches in flight on one device, a further batch is not timed itself but
 * within the next timed batch on its queue (which is charged from the end of the one before it), so work that ends
 * the application's last submits untimed, with 64 in flight, is not charged; the time is wall time per queue, so
 * batches that run at once on several queues are charged for each (a slice then gets less, never more).
 */
#ifndef GPUPPETTI_DUTYCYCLE_H
#define GPUPPETTI_DUTYCYCLE_H

#include <stdint.h>

#include <vulkan/vulkan.h>

#include "accounting.h"

struct duty_calls {
    PFN_vkQueueSubmit QueueSubmit;
    PFN_vkCreateFence CreateFence;
    PFN_vkDestroyFence DestroyFence;
    PFN_vkWaitForFences WaitForFences;
    PFN_vkResetFences ResetFences;
};

struct duty;

/* NULL where the duty cycle cannot run (no thread, no memory): the device is then not throttled. */
struct duty *duty_create(VkDevice device, const struct duty_calls *calls, struct acct *acct, int permille);
/* Before a submit that carries work: wait until the slice may submit again. */
void duty_wait(struct duty *duty);
/* After such a submit succeeded, on the same queue while the application still holds it: mark where the work ends.
 * submitted is when the submit began (duty_now). */
void duty_track(struct duty *duty, VkQueue queue, int64_t submitted);
/* Before the device is destroyed (its work is done by then): stop the thread, destroy the fences. */
void duty_destroy(struct duty *duty);
int64_t duty_now(void);

#endif
