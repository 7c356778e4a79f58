/* A slice's share of GPU time: a cooperative duty cycle on vkQueueSubmit.
 *
 *   GPUPPETTI_VK_COMPUTE  comma-separated, one per slice of GPUPPETTI_VK_SLICES and in its order: the slice's share
 *                         of its GPU's time in thousandths (1 to 1000; 1000 is not throttled)
 *
 * After each batch the layer submits a fence of its own; a thread per device waits for it, takes the batch's GPU
 * time as the time from its start (its submit, or the end of the batch before it on that queue) to its end, and
 * pushes the slice's next allowed submit out by that time divided by the share, from the batch's start (or from when
 * the share let the submit go, where it waited and the thread that made it woke up late). A submit waits for that
 * time. It also waits while the process's batches in flight on the device, not yet charged, are expected to take more
 * than 100 ms times the share (each as long as a batch took of late): a client that queues many batches without
 * waiting is held to its share as it goes, with no more than about 100 ms to pay at its end, instead of holding the
 * GPU for all of them and paying at its next submit. Both waits are for a time, never for a batch to end. A submit is
 * never refused, and work already queued is never stopped: there is no preemption. The time is kept in the slice's
 * record on the allocation's shared page (ledger.h), so every process of a container (and every container of a DRA
 * claim) shares one duty cycle.
 *
 * Where the share is not held exactly: one batch is charged at most 10 s of GPU time (a batch seen to end late,
 * after a SIGSTOP, is not a debt); a batch is charged up to when the thread sees its end, which it sees a little late
 * (about 0.1 ms on an idle CPU, more on a busy one), so short batches with idle time between them are charged a
 * little more than they ran; past 64 batches in flight on one device, a submit waits until the oldest should have
 * ended, and if it still has not, the batch is not timed itself but within the next timed batch on its queue (its
 * time taken as expected), so work that ends the application's last submits untimed is not charged; the time is wall
 * time per queue, so batches that run at once on several queues are charged for each (a slice then gets less, never
 * more).
 */
#ifndef GPUPPETTI_DUTYCYCLE_H
#define GPUPPETTI_DUTYCYCLE_H

#include <stdint.h>

#include <vulkan/vulkan.h>

#include "ledger.h"

struct duty_calls {
    PFN_vkQueueSubmit QueueSubmit;
    PFN_vkCreateFence CreateFence;
    PFN_vkDestroyFence DestroyFence;
    PFN_vkWaitForFences WaitForFences;
    PFN_vkResetFences ResetFences;
};

struct duty;

/* NULL where the duty cycle cannot run (no thread, no memory, no record): the device is then not throttled. record
 * says where the slice's shared record lies; it is read again at each use (a reconnect to the ledger swaps it). */
struct duty *duty_create(VkDevice device, const struct duty_calls *calls,
                         _Atomic(struct ledger_shared_slice *) *record, int permille);
/* Before a submit that carries work: wait until the slice may submit again. Returns the time the slice's share let
 * it go where it had to wait for that (else 0), for duty_track. */
int64_t duty_wait(struct duty *duty);
/* After such a submit succeeded, on the same queue while the application still holds it: mark where the work ends.
 * submitted is when the submit began (duty_now), released what duty_wait returned. */
void duty_track(struct duty *duty, VkQueue queue, int64_t submitted, int64_t released);
/* Before the device is destroyed (its work is done by then): stop the thread, destroy the fences. */
void duty_destroy(struct duty *duty);
int64_t duty_now(void);

#endif
