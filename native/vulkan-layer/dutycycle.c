#define _GNU_SOURCE
#include "dutycycle.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

/* pthread_create and pthread_join moved into libc in glibc 2.34 under a new version. Bind the first version of each,
 * which glibc 2.34 and later still provide (in libc) and older ones do (in libpthread, linked in as well), so the
 * layer loads in containers with an older glibc too. */
#if defined(__x86_64__)
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver pthread_create,pthread_create@GLIBC_2.17");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.17");
#endif

/* The most one batch is charged: a batch whose end was seen late (a process stopped with SIGSTOP) is not a debt
 * the slice ran up. A batch that really runs longer than this times the share gets more than its share. */
#define MAX_CHARGE_NS 10000000000LL
/* A time to wait for that lies further ahead than every batch in flight could have charged is not a debt but a
 * time from another boot (CLOCK_MONOTONIC starts again): it is forgotten. */
#define STALE_NS (2 * RING * MAX_CHARGE_NS)

/* Batches in flight that are timed. One submitted while all are in flight is not timed itself, nor waited for (a
 * batch may wait on something the host signals only after it submits more): the queue runs it before the next timed
 * one, which is charged from the end of the timed one before it, and so for it too. */
#define RING 64
#define QUEUES 16

struct record {
    VkQueue queue;
    VkFence fence;
    int64_t submitted;
};

struct duty {
    VkDevice device;
    struct duty_calls calls;
    struct acct *acct;
    int permille;

    pthread_mutex_t lock;
    pthread_cond_t wake;
    struct record ring[RING];
    unsigned head, tail;     /* in flight: ring[head % RING] up to tail */
    VkFence spare[RING];
    int spare_count;
    VkFence fences[RING];    /* every fence made, to destroy */
    int fence_count;
    bool stop;
    pthread_t thread;

    /* The thread's own: where the last timed batch on each queue ended. */
    VkQueue queues[QUEUES];
    int64_t ended[QUEUES];
};

int64_t duty_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static _Atomic int64_t *not_before(struct duty *duty)
{
    return &duty->acct->file->not_before_ns;
}

/* The slice may submit again once it has waited a batch's time over its share, from the batch's start. */
static void push_out(struct duty *duty, int64_t start, int64_t took)
{
    if (took > MAX_CHARGE_NS) {
        took = MAX_CHARGE_NS;
    }
    int64_t cost = took * 1000 / duty->permille;
    _Atomic int64_t *shared = not_before(duty);
    int64_t current = atomic_load(shared);
    int64_t next;
    do {
        /* Time the slice did not use is not saved up: it starts from the batch's start at the latest. */
        int64_t base = current > start ? current : start;
        next = base > INT64_MAX - cost ? INT64_MAX : base + cost; /* the file is the container's to write */
    } while (!atomic_compare_exchange_weak(shared, &current, next));
}

/* A batch ran from start to end: the slice may submit again once it has waited that long over its share. */
static void charge(struct duty *duty, VkQueue queue, int64_t submitted, int64_t end)
{
    int64_t start = submitted;
    int index = -1;
    for (int i = 0; i < QUEUES; i++) {
        if (duty->queues[i] == queue || duty->queues[i] == VK_NULL_HANDLE) {
            index = i;
            break;
        }
    }
    if (index >= 0) {
        /* Work queued behind an earlier batch starts when that one ends. */
        if (duty->queues[index] == queue && duty->ended[index] > start) {
            start = duty->ended[index];
        }
        duty->queues[index] = queue;
        duty->ended[index] = end;
    }
    if (end <= start) {
        return;
    }
    push_out(duty, start, end - start);
}

static void *wait_for_batches(void *argument)
{
    struct duty *duty = argument;
    pthread_mutex_lock(&duty->lock);
    for (;;) {
        while (duty->head == duty->tail && !duty->stop) {
            pthread_cond_wait(&duty->wake, &duty->lock);
        }
        if (duty->head == duty->tail) {
            break;
        }
        struct record record = duty->ring[duty->head % RING];
        pthread_mutex_unlock(&duty->lock);
        VkResult result = duty->calls.WaitForFences(duty->device, 1, &record.fence, VK_TRUE, UINT64_MAX);
        int64_t end = duty_now();
        if (result == VK_SUCCESS) {
            charge(duty, record.queue, record.submitted, end);
            duty->calls.ResetFences(duty->device, 1, &record.fence);
        }
        pthread_mutex_lock(&duty->lock);
        duty->head++;
        if (result == VK_SUCCESS) {
            duty->spare[duty->spare_count++] = record.fence;
        }
    }
    pthread_mutex_unlock(&duty->lock);
    return NULL;
}

struct duty *duty_create(VkDevice device, const struct duty_calls *calls, struct acct *acct, int permille)
{
    if (permille <= 0 || permille >= 1000 || acct == NULL || acct->file == NULL || calls->QueueSubmit == NULL ||
        calls->CreateFence == NULL || calls->DestroyFence == NULL || calls->WaitForFences == NULL ||
        calls->ResetFences == NULL) {
        return NULL;
    }
    struct duty *duty = calloc(1, sizeof *duty);
    if (duty == NULL) {
        return NULL;
    }
    duty->device = device;
    duty->calls = *calls;
    duty->acct = acct;
    duty->permille = permille;
    pthread_mutex_init(&duty->lock, NULL);
    pthread_cond_init(&duty->wake, NULL);
    if (pthread_create(&duty->thread, NULL, wait_for_batches, duty) != 0) {
        pthread_cond_destroy(&duty->wake);
        pthread_mutex_destroy(&duty->lock);
        free(duty);
        return NULL;
    }
    return duty;
}

void duty_wait(struct duty *duty)
{
    for (;;) {
        int64_t now = duty_now();
        int64_t until = atomic_load(not_before(duty));
        if (until <= now) {
            return;
        }
        int64_t wait = until - now;
        if (wait > STALE_NS) {
            atomic_compare_exchange_strong(not_before(duty), &until, now);
            continue;
        }
        /* In steps of at most a second: another process of the slice may move the time while this one sleeps. */
        if (wait > 1000000000) {
            wait = 1000000000;
        }
        struct timespec pause = {.tv_sec = wait / 1000000000, .tv_nsec = wait % 1000000000};
        int64_t began = duty_now();
        while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
        }
        atomic_fetch_add(&duty->acct->file->waited_ns, duty_now() - began);
    }
}

void duty_track(struct duty *duty, VkQueue queue, int64_t submitted)
{
    VkFence fence = VK_NULL_HANDLE;
    pthread_mutex_lock(&duty->lock);
    bool room = duty->tail - duty->head < RING;
    if (room && duty->spare_count > 0) {
        fence = duty->spare[--duty->spare_count];
    } else if (room && duty->fence_count < RING) {
        VkFenceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
        if (duty->calls.CreateFence(duty->device, &info, NULL, &fence) == VK_SUCCESS) {
            duty->fences[duty->fence_count++] = fence;
        } else {
            fence = VK_NULL_HANDLE;
        }
    }
    pthread_mutex_unlock(&duty->lock);
    if (fence == VK_NULL_HANDLE) {
        return;
    }
    /* An empty submit with a fence: it signals when everything submitted to the queue before it is done. */
    if (duty->calls.QueueSubmit(queue, 0, NULL, fence) != VK_SUCCESS) {
        pthread_mutex_lock(&duty->lock);
        duty->spare[duty->spare_count++] = fence;
        pthread_mutex_unlock(&duty->lock);
        return;
    }
    pthread_mutex_lock(&duty->lock);
    duty->ring[duty->tail % RING] = (struct record){.queue = queue, .fence = fence, .submitted = submitted};
    duty->tail++;
    pthread_cond_signal(&duty->wake);
    pthread_mutex_unlock(&duty->lock);
}

void duty_destroy(struct duty *duty)
{
    if (duty == NULL) {
        return;
    }
    pthread_mutex_lock(&duty->lock);
    duty->stop = true;
    pthread_cond_signal(&duty->wake);
    pthread_mutex_unlock(&duty->lock);
    pthread_join(duty->thread, NULL);
    for (int i = 0; i < duty->fence_count; i++) {
        duty->calls.DestroyFence(duty->device, duty->fences[i], NULL);
    }
    pthread_cond_destroy(&duty->wake);
    pthread_mutex_destroy(&duty->lock);
    free(duty);
}
