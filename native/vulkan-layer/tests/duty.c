/* The compute duty cycle (dutycycle.c) on a simulated GPU, built with AddressSanitizer and UBSan like the layer (make
 * check). The GPU is one queue that runs its batches one after the other, each for the time it was given, and
 * signals each fence once everything before it has run, as a GPU does; it keeps when each batch ran. The workloads
 * submit as an application does through the layer (duty_wait, the submit, duty_track), and what a share gave them is
 * the GPU time their batches took over the wall time they ran, from their first submit to their last batch's end.
 *
 * On lavapipe the GPU is this machine's CPU, and its timing rides on everything else that runs there; here batches
 * take the time they are given, and the scenarios can make what lavapipe cannot (a thread that wakes up late, a
 * batch held by the host).
 *
 *   duty             run every scenario, each in a process of its own
 *   duty SCENARIO    run one
 *
 * A scenario that times the share runs up to three times, and passes when one run holds (the machine may be busy).
 * Exit status: 0 when every scenario passed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <vulkan/vulkan.h>

#include "../dutycycle.h"
#include "../ledger.h"
#include "check.h"

#define MS 1000000LL

/* -- the simulated GPU ------------------------------------------------------------------------------------------ */

struct fence {
    pthread_mutex_t lock;
    pthread_cond_t signalled;
    bool done;
};

/* What the queue runs: a batch of `duration` (held until *gate is true, where it has one), or a fence to signal. */
struct item {
    int64_t duration;
    atomic_bool *gate;
    struct fence *fence;
};

#define ITEMS 65536
#define RUNS 16384

struct gpu {
    pthread_mutex_t lock;
    pthread_cond_t more;
    struct item *items;
    unsigned head, tail;
    bool stop;
    pthread_t thread;
    /* When each batch ran. */
    int64_t (*ran)[2];
    atomic_int batches;
    atomic_int fences_made, fences_destroyed;
};

static struct gpu gpu;

static VkQueue the_queue(void)
{
    return (VkQueue)(void *)&gpu;
}

static VkFence to_handle(struct fence *fence)
{
#if defined(VK_USE_64_BIT_PTR_DEFINES) && VK_USE_64_BIT_PTR_DEFINES == 1
    return (VkFence)(void *)fence;
#else
    return (VkFence)(uintptr_t)fence;
#endif
}

static struct fence *from_handle(VkFence handle)
{
#if defined(VK_USE_64_BIT_PTR_DEFINES) && VK_USE_64_BIT_PTR_DEFINES == 1
    return (struct fence *)(void *)handle;
#else
    return (struct fence *)(uintptr_t)handle;
#endif
}

static void fence_signal(struct fence *fence)
{
    pthread_mutex_lock(&fence->lock);
    fence->done = true;
    pthread_cond_broadcast(&fence->signalled);
    pthread_mutex_unlock(&fence->lock);
}

static void fence_wait(struct fence *fence)
{
    pthread_mutex_lock(&fence->lock);
    while (!fence->done) {
        pthread_cond_wait(&fence->signalled, &fence->lock);
    }
    pthread_mutex_unlock(&fence->lock);
}

static struct fence *fence_make(void)
{
    struct fence *fence = calloc(1, sizeof *fence);
    if (fence == NULL) {
        abort();
    }
    pthread_mutex_init(&fence->lock, NULL);
    pthread_cond_init(&fence->signalled, NULL);
    return fence;
}

static void fence_free(struct fence *fence)
{
    pthread_cond_destroy(&fence->signalled);
    pthread_mutex_destroy(&fence->lock);
    free(fence);
}

static void *run_queue(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&gpu.lock);
    for (;;) {
        while (gpu.head == gpu.tail && !gpu.stop) {
            pthread_cond_wait(&gpu.more, &gpu.lock);
        }
        if (gpu.head == gpu.tail) {
            break;
        }
        struct item item = gpu.items[gpu.head % ITEMS];
        pthread_mutex_unlock(&gpu.lock);
        if (item.fence != NULL) {
            fence_signal(item.fence);
        } else {
            while (item.gate != NULL && !atomic_load(item.gate)) {
                usleep(200);
            }
            int64_t start = duty_now();
            int64_t until = start + item.duration;
            struct timespec at = {.tv_sec = until / 1000000000, .tv_nsec = until % 1000000000};
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL) == EINTR) {
            }
            int batch = atomic_load(&gpu.batches);
            if (batch < RUNS) {
                gpu.ran[batch][0] = start;
                gpu.ran[batch][1] = duty_now();
            }
            atomic_store(&gpu.batches, batch + 1);
        }
        pthread_mutex_lock(&gpu.lock);
        gpu.head++;
    }
    pthread_mutex_unlock(&gpu.lock);
    return NULL;
}

/* Items of one submit, queued together. */
static void enqueue_all(const struct item *items, unsigned count)
{
    pthread_mutex_lock(&gpu.lock);
    if (gpu.tail - gpu.head > ITEMS - count) {
        abort();
    }
    for (unsigned i = 0; i < count; i++) {
        gpu.items[gpu.tail % ITEMS] = items[i];
        gpu.tail++;
    }
    pthread_cond_signal(&gpu.more);
    pthread_mutex_unlock(&gpu.lock);
}

static void enqueue(struct item item)
{
    enqueue_all(&item, 1);
}

static void gpu_start(void)
{
    memset(&gpu, 0, sizeof gpu);
    gpu.items = calloc(ITEMS, sizeof *gpu.items);
    gpu.ran = calloc(RUNS, sizeof *gpu.ran);
    if (gpu.items == NULL || gpu.ran == NULL) {
        abort();
    }
    pthread_mutex_init(&gpu.lock, NULL);
    pthread_cond_init(&gpu.more, NULL);
    pthread_create(&gpu.thread, NULL, run_queue, NULL);
}

static void gpu_stop(void)
{
    pthread_mutex_lock(&gpu.lock);
    gpu.stop = true;
    pthread_cond_signal(&gpu.more);
    pthread_mutex_unlock(&gpu.lock);
    pthread_join(gpu.thread, NULL);
    pthread_cond_destroy(&gpu.more);
    pthread_mutex_destroy(&gpu.lock);
    free(gpu.items);
    free(gpu.ran);
}

/* The GPU time batches ran between from and to, over that time. */
static double gpu_part(int64_t from, int64_t to)
{
    int64_t busy = 0;
    int batches = atomic_load(&gpu.batches);
    for (int i = 0; i < batches && i < RUNS; i++) {
        int64_t start = gpu.ran[i][0] > from ? gpu.ran[i][0] : from;
        int64_t end = gpu.ran[i][1] < to ? gpu.ran[i][1] : to;
        if (end > start) {
            busy += end - start;
        }
    }
    return to > from ? (double)busy / (double)(to - from) : 0.0;
}

/* -- the calls the duty cycle makes, on the simulated GPU --------------------------------------------------------- */

static VKAPI_ATTR VkResult VKAPI_CALL sim_QueueSubmit(VkQueue queue, uint32_t count, const VkSubmitInfo *submits,
                                                      VkFence fence)
{
    (void)submits;
    if (queue != the_queue() || count != 0 || fence == VK_NULL_HANDLE) {
        CHECK(false, "the duty cycle submitted something other than an empty submit with a fence");
        return VK_ERROR_UNKNOWN;
    }
    enqueue((struct item){.fence = from_handle(fence)});
    return VK_SUCCESS;
}

static VKAPI_ATTR VkResult VKAPI_CALL sim_CreateFence(VkDevice device, const VkFenceCreateInfo *info,
                                                      const VkAllocationCallbacks *allocator, VkFence *out)
{
    (void)device;
    (void)info;
    (void)allocator;
    *out = to_handle(fence_make());
    atomic_fetch_add(&gpu.fences_made, 1);
    return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL sim_DestroyFence(VkDevice device, VkFence fence,
                                                   const VkAllocationCallbacks *allocator)
{
    (void)device;
    (void)allocator;
    if (fence != VK_NULL_HANDLE) {
        fence_free(from_handle(fence));
        atomic_fetch_add(&gpu.fences_destroyed, 1);
    }
}

static VKAPI_ATTR VkResult VKAPI_CALL sim_WaitForFences(VkDevice device, uint32_t count, const VkFence *fences,
                                                        VkBool32 all, uint64_t timeout)
{
    (void)device;
    (void)all;
    (void)timeout;
    for (uint32_t i = 0; i < count; i++) {
        fence_wait(from_handle(fences[i]));
    }
    return VK_SUCCESS;
}

static VKAPI_ATTR VkResult VKAPI_CALL sim_ResetFences(VkDevice device, uint32_t count, const VkFence *fences)
{
    (void)device;
    for (uint32_t i = 0; i < count; i++) {
        struct fence *fence = from_handle(fences[i]);
        pthread_mutex_lock(&fence->lock);
        fence->done = false;
        pthread_mutex_unlock(&fence->lock);
    }
    return VK_SUCCESS;
}

/* -- a workload, as an application submits through the layer ------------------------------------------------------ */

struct workload {
    struct ledger_shared_slice *page;                 /* the slice's record, as on the shared page */
    _Atomic(struct ledger_shared_slice *) record;   /* where the ledger says it lies */
    struct duty *duty;
    int64_t first;   /* its first submit */
    int submits;
    int64_t late;    /* how late its thread wakes up from a wait, as on a busy CPU */
};

static void workload_start(struct workload *work, int permille)
{
    memset(work, 0, sizeof *work);
    gpu_start();
    work->page = calloc(2, sizeof *work->page);
    if (work->page == NULL) {
        abort();
    }
    atomic_store(&work->record, work->page);
    struct duty_calls calls = {.QueueSubmit = sim_QueueSubmit, .CreateFence = sim_CreateFence,
                               .DestroyFence = sim_DestroyFence, .WaitForFences = sim_WaitForFences,
                               .ResetFences = sim_ResetFences};
    work->duty = duty_create((VkDevice)(void *)&gpu, &calls, &work->record, permille);
    CHECK(work->duty != NULL, "duty_create with a share of %d", permille);
    if (work->duty == NULL) {
        exit(1);
    }
}

/* vkQueueSubmit of one batch of that duration, with the application's fence where it gives one: what the layer does
 * around it. */
static void submit(struct workload *work, int64_t duration, struct fence *fence, atomic_bool *gate)
{
    int64_t asked = duty_now();
    int64_t released = duty_wait(work->duty);
    if (work->late > 0 && duty_now() - asked > MS / 10) {
        /* It waited, and its thread ran again only that much later. */
        struct timespec late = {.tv_sec = 0, .tv_nsec = work->late};
        while (nanosleep(&late, &late) != 0 && errno == EINTR) {
        }
    }
    int64_t submitted = duty_now();
    if (work->submits++ == 0) {
        work->first = submitted;
    }
    /* One submit: the batch, then its fence. */
    struct item items[2] = {{.duration = duration, .gate = gate}, {.fence = fence}};
    enqueue_all(items, fence != NULL ? 2 : 1);
    duty_track(work->duty, the_queue(), submitted, released);
}

/* Everything submitted has run: a fence after it all, as vkQueueWaitIdle. */
static void wait_idle(void)
{
    struct fence *idle = fence_make();
    enqueue((struct item){.fence = idle});
    fence_wait(idle);
    fence_free(idle);
}

static void workload_end(struct workload *work)
{
    duty_destroy(work->duty);
    gpu_stop();
    CHECK(atomic_load(&gpu.fences_made) == atomic_load(&gpu.fences_destroyed), "%d fences made, %d destroyed",
          atomic_load(&gpu.fences_made), atomic_load(&gpu.fences_destroyed));
    free(work->page);
}

static bool near(double got, double share)
{
    return got >= share * 0.9 && got <= share * 1.1;
}

/* -- scenarios ---------------------------------------------------------------------------------------------------- */

/* A workload that keeps `in_flight` batches queued, waiting for the oldest before it submits again, for `seconds`:
 * the part of the GPU's time its batches took. */
static double in_flight_run(int permille, int in_flight, int64_t batch, int64_t seconds_ns, int64_t late)
{
    struct workload work;
    workload_start(&work, permille);
    work.late = late;
    struct fence *fences[8] = {0};
    int64_t until = duty_now() + seconds_ns;
    int slot = 0;
    while (duty_now() < until) {
        if (fences[slot] != NULL) {
            fence_wait(fences[slot]);
            fence_free(fences[slot]);
        }
        fences[slot] = fence_make();
        submit(&work, batch, fences[slot], NULL);
        slot = (slot + 1) % in_flight;
    }
    for (int i = 0; i < in_flight; i++) {
        if (fences[i] != NULL) {
            fence_wait(fences[i]);
            fence_free(fences[i]);
        }
    }
    int64_t end = duty_now();
    double part = gpu_part(work.first, end);
    workload_end(&work);
    return part;
}

static void in_flight_share(int in_flight)
{
    static const int shares[] = {500, 250};
    for (size_t i = 0; i < sizeof shares / sizeof *shares; i++) {
        double share = shares[i] / 1000.0, got = 0;
        for (int tries = 0; tries < 3; tries++) {
            got = in_flight_run(shares[i], in_flight, 4 * MS, 1200 * MS, 0);
            printf("    %d in flight, share %.0f %%: the GPU's time %.1f %%\n", in_flight, 100 * share, 100 * got);
            if (near(got, share)) {
                break;
            }
        }
        CHECK(near(got, share), "%d in flight, share %.0f %%: got %.1f %%", in_flight, 100 * share, 100 * got);
    }
}

static void one_in_flight(void)
{
    in_flight_share(1);
}

static void three_in_flight(void)
{
    in_flight_share(3);
}

/* The thread that submits runs again 2 ms after each wait ends (a busy CPU, where a thread that wakes waits its turn):
 * the GPU idles meanwhile, and that time is not the slice's. */
static void late_wakeups(void)
{
    double got = 0;
    for (int tries = 0; tries < 3; tries++) {
        got = in_flight_run(500, 1, 4 * MS, 1200 * MS, 2 * MS);
        printf("    waking 2 ms late, share 50 %%: the GPU's time %.1f %%\n", 100 * got);
        if (near(got, 0.5)) {
            break;
        }
    }
    CHECK(near(got, 0.5), "waking 2 ms late, share 50 %%: got %.1f %%", 100 * got);
}

/* A client that queues many batches without waiting for any, waits for them all, then submits once more. */
static void unsynchronised_run(int permille, int batches, int64_t batch, double *part, double *next_wait)
{
    struct workload work;
    workload_start(&work, permille);
    for (int i = 0; i < batches; i++) {
        submit(&work, batch, NULL, NULL);
    }
    wait_idle();
    int64_t end = duty_now();
    *part = gpu_part(work.first, end);
    int64_t before = duty_now();
    submit(&work, batch, NULL, NULL);
    *next_wait = (double)(duty_now() - before) / 1e9;
    wait_idle();
    workload_end(&work);
}

static void unsynchronised(void)
{
    static const int shares[] = {500, 250};
    for (size_t i = 0; i < sizeof shares / sizeof *shares; i++) {
        double share = shares[i] / 1000.0, got = 0, next_wait = 0;
        /* 600 ms of GPU time at 50 %, 300 ms at 25 %: a run of 1.2 s either way. */
        int batches = shares[i] == 500 ? 300 : 150;
        for (int tries = 0; tries < 3; tries++) {
            unsynchronised_run(shares[i], batches, 2 * MS, &got, &next_wait);
            printf("    %d batches queued at once, share %.0f %%: the GPU's time %.1f %% over the run, the next "
                   "submit waited %.0f ms\n", batches, 100 * share, 100 * got, 1000 * next_wait);
            if (near(got, share) && next_wait <= 0.25) {
                break;
            }
        }
        CHECK(near(got, share), "%d batches queued at once, share %.0f %%: got %.1f %% over the run", batches,
              100 * share, 100 * got);
        /* What is left to pay at the end is the bounded debt in flight (dutycycle.h), not the run's. */
        CHECK(next_wait <= 0.25, "the next submit waited %.3f s", next_wait);
    }
}

/* Very short batches, far more than the duty cycle times at once: no crash, nothing refused, the share still
 * roughly held. */
static void many_short_batches(void)
{
    double got = 0, next_wait = 0;
    for (int tries = 0; tries < 3; tries++) {
        unsynchronised_run(500, 3000, MS / 5, &got, &next_wait);
        printf("    3000 batches of 0.2 ms queued at once, share 50 %%: the GPU's time %.1f %%, the next submit "
               "waited %.0f ms\n", 100 * got, 1000 * next_wait);
        if (got <= 0.6 && next_wait <= 0.25) {
            break;
        }
    }
    CHECK(got <= 0.6, "got %.1f %%", 100 * got);
    CHECK(next_wait <= 0.25, "the next submit waited %.3f s", next_wait);
}

/* An application that stays within its share, three batches at a time and 20 ms between the end of one burst and
 * the next (under 25 % of the GPU, with a 50 % share): no submit is held back, so each burst's batches are queued
 * together and run back to back. Its time held back in all, in ms. */
static double pipelined_run(void)
{
    struct workload work;
    workload_start(&work, 500);
    for (int burst = 0; burst < 25; burst++) {
        struct fence *last = fence_make();
        for (int i = 0; i < 3; i++) {
            submit(&work, 2 * MS, i == 2 ? last : NULL, NULL);
        }
        fence_wait(last);
        fence_free(last);
        struct timespec pause = {.tv_sec = 0, .tv_nsec = 20 * MS};
        while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
        }
    }
    wait_idle();
    double waited = atomic_load(&work.page->waited_ns) / 1e6;
    int batches = atomic_load(&gpu.batches);
    int64_t gaps = 0;
    for (int i = 1; i < batches && i < RUNS; i++) {
        if (i % 3 != 0) {
            gaps += gpu.ran[i][0] - gpu.ran[i - 1][1];
        }
    }
    printf("    75 batches in bursts of 3 within the share: held back %.1f ms in all; the GPU waited %.2f ms in all "
           "between the batches of a burst\n", waited, gaps / 1e6);
    workload_end(&work);
    return waited;
}

static void pipelined_within_share(void)
{
    double waited = 0;
    for (int tries = 0; tries < 3; tries++) {
        waited = pipelined_run();
        if (waited == 0) {
            break;
        }
    }
    CHECK(waited == 0, "an application within its share was held back %.1f ms", waited);
}

/* The first batch waits for something the host does only after it has submitted 200 more (an event it sets, a
 * semaphore it signals): no submit waits for batches to end, so none waits for ever. */
static void held_by_the_host(void)
{
    struct workload work;
    workload_start(&work, 500);
    atomic_bool gate = false;
    int64_t began = duty_now();
    submit(&work, 2 * MS, NULL, &gate);
    for (int i = 0; i < 200; i++) {
        submit(&work, 2 * MS, NULL, NULL);
    }
    int64_t submitted = duty_now() - began;
    atomic_store(&gate, true);
    wait_idle();
    printf("    201 submits behind a batch the host holds: %.2f s to submit them all\n", submitted / 1e9);
    CHECK(submitted < 30 * 1000 * MS, "%.1f s to submit", submitted / 1e9);
    workload_end(&work);
}

/* A reconnect to the ledger swaps the slice's record for the new shared page's: the duty cycle follows it at once,
 * and counts its waits there. */
static void record_swapped(void)
{
    struct workload work;
    workload_start(&work, 500);
    struct ledger_shared_slice *fresh = &work.page[1];
    atomic_store(&fresh->not_before_ns, duty_now() + 200 * MS);
    atomic_store(&work.record, fresh);
    int64_t began = duty_now();
    submit(&work, MS, NULL, NULL);
    int64_t waited = duty_now() - began;
    wait_idle();
    printf("    a submit after the swap waited %.0f ms\n", waited / 1e6);
    CHECK(waited >= 190 * MS, "the submit waited %.0f ms, not the new record's 200", waited / 1e6);
    CHECK(atomic_load(&fresh->waited_ns) >= 190 * MS && atomic_load(&work.page[0].waited_ns) == 0,
          "the wait was counted in the old record (%lld ns), not the new (%lld ns)",
          (long long)atomic_load(&work.page[0].waited_ns), (long long)atomic_load(&fresh->waited_ns));
    workload_end(&work);
}

struct scenario {
    const char *name;
    void (*run)(void);
};

static const struct scenario scenarios[] = {
    {"one-in-flight", one_in_flight},
    {"three-in-flight", three_in_flight},
    {"late-wakeups", late_wakeups},
    {"unsynchronised", unsynchronised},
    {"many-short-batches", many_short_batches},
    {"pipelined-within-share", pipelined_within_share},
    {"held-by-the-host", held_by_the_host},
    {"record-swapped", record_swapped},
};

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 2) {
        for (size_t i = 0; i < sizeof scenarios / sizeof *scenarios; i++) {
            if (strcmp(argv[1], scenarios[i].name) == 0) {
                scenario_name = scenarios[i].name;
                /* A submit that waited for ever would hang the check: it fails it instead. */
                alarm(120);
                scenarios[i].run();
                return failures == 0 ? 0 : 1;
            }
        }
        fprintf(stderr, "duty: no scenario %s\n", argv[1]);
        return 2;
    }
    bool ok = true;
    for (size_t i = 0; i < sizeof scenarios / sizeof *scenarios; i++) {
        fflush(stdout);
        pid_t child = fork();
        if (child == 0) {
            execl(argv[0], argv[0], scenarios[i].name, (char *)NULL);
            _exit(127);
        }
        int status = 0;
        waitpid(child, &status, 0);
        bool passed = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        printf("%-22s %-6s (duty cycle, simulated GPU)\n", scenarios[i].name, passed ? "ok" : "FAILED");
        if (WIFSIGNALED(status)) {
            printf("    killed by signal %d\n", WTERMSIG(status));
        }
        ok &= passed;
    }
    printf("%s\n", ok ? "every duty cycle scenario passed" : "some duty cycle scenarios FAILED");
    return ok ? 0 : 1;
}
