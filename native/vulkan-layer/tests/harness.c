/* The layer's behaviour, in C, through the real Vulkan loader on a real driver (Mesa's lavapipe): built with
 * AddressSanitizer and UndefinedBehaviorSanitizer, like the layer it loads (make check).
 *
 *   harness                 run every scenario, each in a process of its own with its own environment
 *   harness SCENARIO        run one (the environment already set)
 *
 * The layer is enabled as an explicit layer (VK_LAYER_PATH, VK_INSTANCE_LAYERS: make check sets them), so that
 * nothing needs installing. Exit status: 0 when every scenario passed, 1 otherwise; a scenario that crashes or that
 * a sanitizer stops is a failure.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <vulkan/vulkan.h>

#include "../accounting.h"

#define MIB (1024ull * 1024ull)
#define SLICE_MIB 256

static const char *scenario_name = "";
static int failures;

#define CHECK(condition, ...)                                                                                        \
    do {                                                                                                             \
        if (!(condition)) {                                                                                          \
            fprintf(stderr, "%s: %s:%d: %s: ", scenario_name, __FILE__, __LINE__, #condition);                       \
            fprintf(stderr, __VA_ARGS__);                                                                            \
            fputc('\n', stderr);                                                                                     \
            failures++;                                                                                              \
        }                                                                                                            \
    } while (0)

/* -- Vulkan helpers -------------------------------------------------------------------------------------------- */

static VkInstance make_instance(void)
{
    VkApplicationInfo application = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO, .apiVersion = VK_API_VERSION_1_1};
    VkInstanceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &application};
    VkInstance instance = VK_NULL_HANDLE;
    VkResult result = vkCreateInstance(&info, NULL, &instance);
    CHECK(result == VK_SUCCESS, "vkCreateInstance: %d", result);
    return result == VK_SUCCESS ? instance : VK_NULL_HANDLE;
}

static VkPhysicalDevice first_gpu(VkInstance instance)
{
    uint32_t count = 1;
    VkPhysicalDevice physical = VK_NULL_HANDLE;
    VkResult result = vkEnumeratePhysicalDevices(instance, &count, &physical);
    CHECK(result == VK_SUCCESS || result == VK_INCOMPLETE, "vkEnumeratePhysicalDevices: %d", result);
    CHECK(count == 1 && physical != VK_NULL_HANDLE, "no GPU enumerated");
    return physical;
}

static bool has_device_extension(VkPhysicalDevice physical, const char *name, int *times)
{
    uint32_t count = 0;
    vkEnumerateDeviceExtensionProperties(physical, NULL, &count, NULL);
    VkExtensionProperties *properties = calloc(count ? count : 1, sizeof *properties);
    vkEnumerateDeviceExtensionProperties(physical, NULL, &count, properties);
    int found = 0;
    for (uint32_t i = 0; i < count; i++) {
        found += strcmp(properties[i].extensionName, name) == 0;
    }
    free(properties);
    if (times != NULL) {
        *times = found;
    }
    return found > 0;
}

static VkDevice make_device(VkPhysicalDevice physical, const char *const *extensions, uint32_t extension_count)
{
    float priority = 1.0f;
    VkDeviceQueueCreateInfo queue = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, .queueFamilyIndex = 0,
                                     .queueCount = 1, .pQueuePriorities = &priority};
    VkDeviceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, .queueCreateInfoCount = 1,
                               .pQueueCreateInfos = &queue, .enabledExtensionCount = extension_count,
                               .ppEnabledExtensionNames = extensions};
    VkDevice device = VK_NULL_HANDLE;
    VkResult result = vkCreateDevice(physical, &info, NULL, &device);
    CHECK(result == VK_SUCCESS, "vkCreateDevice: %d", result);
    return result == VK_SUCCESS ? device : VK_NULL_HANDLE;
}

static VkResult allocate(VkDevice device, VkDeviceSize size, const void *next, VkDeviceMemory *out)
{
    VkMemoryAllocateInfo info = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, .pNext = next,
                                 .allocationSize = size, .memoryTypeIndex = 0};
    return vkAllocateMemory(device, &info, NULL, out);
}

static void budget_of(VkPhysicalDevice physical, VkDeviceSize *heap_size, VkDeviceSize *budget, VkDeviceSize *usage)
{
    VkPhysicalDeviceMemoryBudgetPropertiesEXT budgets = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT};
    VkPhysicalDeviceMemoryProperties2 memory = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
                                                .pNext = &budgets};
    vkGetPhysicalDeviceMemoryProperties2(physical, &memory);
    *heap_size = memory.memoryProperties.memoryHeaps[0].size;
    *budget = budgets.heapBudget[0];
    *usage = budgets.heapUsage[0];
}

/* Allocate chunks until refused: how much was obtained, and the refusal. */
static VkDeviceSize fill(VkDevice device, VkDeviceSize chunk, VkResult *refusal, VkDeviceMemory *held, int room)
{
    VkDeviceSize total = 0;
    *refusal = VK_SUCCESS;
    for (int i = 0; i < room; i++) {
        VkResult result = allocate(device, chunk, NULL, &held[i]);
        if (result != VK_SUCCESS) {
            *refusal = result;
            held[i] = VK_NULL_HANDLE;
            break;
        }
        total += chunk;
    }
    return total;
}

/* -- scenarios ------------------------------------------------------------------------------------------------- */

/* Twenty instances alive at once: each enumerates its GPU and creates a device. */
static void many_instances(void)
{
    enum { COUNT = 20 };
    VkInstance instances[COUNT];
    for (int i = 0; i < COUNT; i++) {
        instances[i] = make_instance();
        if (instances[i] == VK_NULL_HANDLE) {
            return;
        }
    }
    for (int i = 0; i < COUNT; i++) {
        VkPhysicalDevice physical = first_gpu(instances[i]);
        VkDevice device = make_device(physical, NULL, 0);
        VkDeviceMemory memory;
        CHECK(allocate(device, MIB, NULL, &memory) == VK_SUCCESS, "instance %d: allocating 1 MiB failed", i);
        vkFreeMemory(device, memory, NULL);
        vkDestroyDevice(device, NULL);
    }
    for (int i = COUNT - 1; i >= 0; i--) {
        vkDestroyInstance(instances[i], NULL);
    }
}

/* Seventy devices alive at once: each allocates, and creates and binds a buffer. */
static void many_devices(void)
{
    enum { COUNT = 70 };
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    VkDevice devices[COUNT];
    VkDeviceMemory memories[COUNT];
    VkBuffer buffers[COUNT];
    for (int i = 0; i < COUNT; i++) {
        devices[i] = make_device(physical, NULL, 0);
        if (devices[i] == VK_NULL_HANDLE) {
            return;
        }
    }
    for (int i = 0; i < COUNT; i++) {
        VkResult result = allocate(devices[i], MIB, NULL, &memories[i]);
        CHECK(result == VK_SUCCESS, "device %d: vkAllocateMemory: %d", i, result);
        VkBufferCreateInfo info = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .size = MIB,
                                   .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT};
        result = vkCreateBuffer(devices[i], &info, NULL, &buffers[i]);
        CHECK(result == VK_SUCCESS, "device %d: vkCreateBuffer: %d", i, result);
        CHECK(vkBindBufferMemory(devices[i], buffers[i], memories[i], 0) == VK_SUCCESS, "device %d: bind", i);
    }
    for (int i = 0; i < COUNT; i++) {
        vkDestroyBuffer(devices[i], buffers[i], NULL);
        vkFreeMemory(devices[i], memories[i], NULL);
        vkDestroyDevice(devices[i], NULL);
    }
    vkDestroyInstance(instance, NULL);
}

/* Without a slice (no env, or one that does not parse): the budget the loader advertises is a real one, and a device
 * that enables it is created. */
static void pass_through_budget(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    int times = 0;
    if (has_device_extension(physical, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME, &times)) {
        CHECK(times == 1, "VK_EXT_memory_budget listed %d times", times);
        VkDeviceSize heap, budget, usage;
        budget_of(physical, &heap, &budget, &usage);
        CHECK(budget > 0 && budget <= heap, "heap 0: budget %llu of %llu", (unsigned long long)budget,
              (unsigned long long)heap);
        const char *extensions[] = {VK_EXT_MEMORY_BUDGET_EXTENSION_NAME};
        VkDevice device = make_device(physical, extensions, 1);
        vkDestroyDevice(device, NULL);
    }
    vkDestroyInstance(instance, NULL);
}

/* In a slice: the heap and the budget are the slice's, and allocation stops at its edge with the driver's own
 * out-of-memory error. */
static void slice_edge(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    int times = 0;
    CHECK(has_device_extension(physical, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME, &times) && times == 1,
          "VK_EXT_memory_budget listed %d times", times);
    VkDeviceSize heap, budget, usage;
    budget_of(physical, &heap, &budget, &usage);
    CHECK(heap <= SLICE_MIB * MIB, "heap 0 is %llu MiB", (unsigned long long)(heap / MIB));
    CHECK(budget > 0 && budget <= SLICE_MIB * MIB, "budget %llu MiB", (unsigned long long)(budget / MIB));
    const char *extensions[] = {VK_EXT_MEMORY_BUDGET_EXTENSION_NAME};
    VkDevice device = make_device(physical, extensions, 1);
    VkDeviceMemory held[64];
    VkResult refusal;
    VkDeviceSize obtained = fill(device, 16 * MIB, &refusal, held, 64);
    CHECK(refusal == VK_ERROR_OUT_OF_DEVICE_MEMORY, "refused with %d", refusal);
    CHECK(obtained <= SLICE_MIB * MIB && obtained >= (SLICE_MIB - 16) * MIB, "obtained %llu MiB",
          (unsigned long long)(obtained / MIB));
    for (int i = 0; i < 64 && held[i] != VK_NULL_HANDLE; i++) {
        vkFreeMemory(device, held[i], NULL);
    }
    budget_of(physical, &heap, &budget, &usage);
    CHECK(usage == 0, "usage %llu after every free", (unsigned long long)usage);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* Memory exported as an fd and freed is still held by whoever has the fd: it stays counted. */
static void exported_memory(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    if (!has_device_extension(physical, VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME, NULL)) {
        printf("%s: skipped: the driver has no VK_KHR_external_memory_fd\n", scenario_name);
        vkDestroyInstance(instance, NULL);
        return;
    }
    const char *extensions[] = {VK_KHR_EXTERNAL_MEMORY_EXTENSION_NAME, VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME};
    VkDevice device = make_device(physical, extensions, 2);
    PFN_vkGetMemoryFdKHR get_fd = (PFN_vkGetMemoryFdKHR)vkGetDeviceProcAddr(device, "vkGetMemoryFdKHR");
    CHECK(get_fd != NULL, "no vkGetMemoryFdKHR");
    VkExportMemoryAllocateInfo export = {.sType = VK_STRUCTURE_TYPE_EXPORT_MEMORY_ALLOCATE_INFO,
                                         .handleTypes = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT};
    VkDeviceMemory memory;
    VkResult result = allocate(device, 200 * MIB, &export, &memory);
    CHECK(result == VK_SUCCESS, "allocating 200 MiB to export: %d", result);
    VkMemoryGetFdInfoKHR info = {.sType = VK_STRUCTURE_TYPE_MEMORY_GET_FD_INFO_KHR, .memory = memory,
                                 .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT};
    int fd = -1;
    if (get_fd != NULL) {
        CHECK(get_fd(device, &info, &fd) == VK_SUCCESS && fd >= 0, "vkGetMemoryFdKHR");
    }
    vkFreeMemory(device, memory, NULL);
    /* The fd keeps the 200 MiB alive: another 200 MiB would pass the slice. */
    VkDeviceMemory more;
    result = allocate(device, 200 * MIB, NULL, &more);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "200 MiB more after an export was given: %d", result);
    if (result == VK_SUCCESS) {
        vkFreeMemory(device, more, NULL);
    }
    /* Imported back, it is not counted twice: it was counted when it was made. */
    if (fd >= 0) {
        VkImportMemoryFdInfoKHR import = {.sType = VK_STRUCTURE_TYPE_IMPORT_MEMORY_FD_INFO_KHR,
                                          .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT, .fd = fd};
        result = allocate(device, 200 * MIB, &import, &memory);
        CHECK(result == VK_SUCCESS, "importing the exported memory: %d", result);
        if (result == VK_SUCCESS) {
            vkFreeMemory(device, memory, NULL);
        } else {
            close(fd);
        }
    }
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* Hold 100 MiB until killed (two at once, then SIGKILLed: see main). */
static void hold(void)
{
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkDeviceMemory memory;
    VkResult result = allocate(device, 100 * MIB, NULL, &memory);
    CHECK(result == VK_SUCCESS, "allocating 100 MiB: %d", result);
    if (failures == 0) {
        pause();
    }
}

/* What killed processes held is in no later process's budget, before anything is refused. */
static void budget_after_kills(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    VkDeviceSize heap, budget, usage;
    budget_of(physical, &heap, &budget, &usage);
    CHECK(usage == 0, "usage %llu MiB after its holders were killed", (unsigned long long)(usage / MIB));
    CHECK(budget >= (SLICE_MIB - 1) * MIB, "budget %llu MiB after its holders were killed",
          (unsigned long long)(budget / MIB));
    vkDestroyInstance(instance, NULL);
}

/* A submit's wait and a batch's charge, with a compute share: many batches in flight, none refused. */
static void throttled_submits(void)
{
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkQueue queue;
    vkGetDeviceQueue(device, 0, 0, &queue);
    for (int i = 0; i < 200; i++) {
        VkResult result = vkQueueSubmit(queue, 0, NULL, VK_NULL_HANDLE);
        CHECK(result == VK_SUCCESS, "empty submit %d: %d", i, result);
    }
    VkSubmitInfo submit = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO};
    for (int i = 0; i < 200; i++) {
        VkResult result = vkQueueSubmit(queue, 1, &submit, VK_NULL_HANDLE);
        CHECK(result == VK_SUCCESS, "submit %d: %d", i, result);
    }
    CHECK(vkQueueWaitIdle(queue) == VK_SUCCESS, "vkQueueWaitIdle");
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* -- running them ---------------------------------------------------------------------------------------------- */

struct scenario {
    const char *name;
    void (*run)(void);
};

static const struct scenario scenarios[] = {
    {"many-instances", many_instances},       {"many-devices", many_devices},
    {"pass-through-budget", pass_through_budget}, {"slice-edge", slice_edge},
    {"exported-memory", exported_memory},     {"hold", hold},
    {"budget-after-kills", budget_after_kills}, {"throttled-submits", throttled_submits},
};

static char accounting_dir[] = "/tmp/gpuppetti-harness-XXXXXX";

/* A slice's accounting file, as the daemons write it (src/gpuppetti/vulkanlayer.py). */
static void make_accounting(void)
{
    char path[sizeof accounting_dir + 32];
    snprintf(path, sizeof path, "%s/slice-0.acct", accounting_dir);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    struct {
        char magic[8];
        uint32_t version, slots;
        int64_t budget;
    } header = {.version = ACCT_VERSION, .slots = ACCT_SLOTS, .budget = (int64_t)(SLICE_MIB * MIB)};
    memcpy(header.magic, ACCT_MAGIC, sizeof header.magic);
    if (fd < 0 || pwrite(fd, &header, sizeof header, 0) != (ssize_t)sizeof header ||
        ftruncate(fd, ACCT_FILE_SIZE) != 0) {
        perror("harness: the accounting file");
        exit(1);
    }
    close(fd);
}

/* Start one scenario in a process of its own with these settings. */
static pid_t start(const char *self, const char *name, const char *slices, const char *compute, bool accounting)
{
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        unsetenv("GPUPPETTI_VK_SLICES");
        unsetenv("GPUPPETTI_VK_COMPUTE");
        unsetenv("GPUPPETTI_VK_ACCOUNTING");
        if (slices != NULL) setenv("GPUPPETTI_VK_SLICES", slices, 1);
        if (compute != NULL) setenv("GPUPPETTI_VK_COMPUTE", compute, 1);
        if (accounting) setenv("GPUPPETTI_VK_ACCOUNTING", accounting_dir, 1);
        execl(self, self, name, (char *)NULL);
        _exit(127);
    }
    return child;
}

/* Run one scenario in a process of its own with these settings; whether it ended as expected. */
static bool run(const char *self, const char *name, const char *slices, const char *compute, bool accounting,
                int expect_signal)
{
    pid_t child = start(self, name, slices, compute, accounting);
    int status = 0;
    waitpid(child, &status, 0);
    bool ok = expect_signal != 0 ? WIFSIGNALED(status) && WTERMSIG(status) == expect_signal
                                 : WIFEXITED(status) && WEXITSTATUS(status) == 0;
    printf("%-22s %-40s %s\n", name, slices != NULL ? slices : "(no slice)", ok ? "ok" : "FAILED");
    if (!ok && WIFSIGNALED(status)) {
        printf("    killed by signal %d\n", WTERMSIG(status));
    }
    return ok;
}

/* Two processes hold 100 MiB each of one slice, and are SIGKILLed. */
static bool killed_holders(const char *self, const char *slice)
{
    pid_t holders[2];
    for (int i = 0; i < 2; i++) {
        holders[i] = start(self, "hold", slice, NULL, true);
    }
    char path[sizeof accounting_dir + 32];
    snprintf(path, sizeof path, "%s/slice-0.acct", accounting_dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    int64_t total = 0;
    for (int tries = 0; tries < 600 && total < (int64_t)(200 * MIB); tries++) {
        if (pread(fd, &total, sizeof total, offsetof(struct acct_file, total)) != (ssize_t)sizeof total) {
            break;
        }
        usleep(50000);
    }
    close(fd);
    bool ok = total == (int64_t)(200 * MIB);
    for (int i = 0; i < 2; i++) {
        kill(holders[i], SIGKILL);
        waitpid(holders[i], NULL, 0);
    }
    printf("%-22s %-40s %s\n", "hold (two, SIGKILLed)", slice, ok ? "ok" : "FAILED");
    return ok;
}

int main(int argc, char **argv)
{
    if (argc == 2) {
        for (size_t i = 0; i < sizeof scenarios / sizeof *scenarios; i++) {
            if (strcmp(argv[1], scenarios[i].name) == 0) {
                scenario_name = scenarios[i].name;
                scenarios[i].run();
                return failures == 0 ? 0 : 1;
            }
        }
        fprintf(stderr, "harness: no scenario %s\n", argv[1]);
        return 2;
    }
    if (mkdtemp(accounting_dir) == NULL) {
        perror("harness: mkdtemp");
        return 1;
    }
    make_accounting();
    char slice[64];
    snprintf(slice, sizeof slice, "any=%llu", (unsigned long long)(SLICE_MIB * MIB));
    bool ok = true;
    ok &= run(argv[0], "many-instances", NULL, NULL, false, 0);
    ok &= run(argv[0], "many-instances", slice, NULL, false, 0);
    ok &= run(argv[0], "many-devices", NULL, NULL, false, 0);
    ok &= run(argv[0], "many-devices", slice, NULL, true, 0);
    ok &= run(argv[0], "pass-through-budget", NULL, NULL, false, 0);
    ok &= run(argv[0], "pass-through-budget", "not a slice", NULL, false, 0);
    ok &= run(argv[0], "slice-edge", slice, NULL, true, 0);
    ok &= run(argv[0], "slice-edge", slice, NULL, false, 0);
    ok &= run(argv[0], "exported-memory", slice, NULL, false, 0);
    ok &= killed_holders(argv[0], slice);
    ok &= run(argv[0], "budget-after-kills", slice, NULL, true, 0);
    ok &= run(argv[0], "throttled-submits", slice, "250", true, 0);
    char path[sizeof accounting_dir + 32];
    snprintf(path, sizeof path, "%s/slice-0.acct", accounting_dir);
    unlink(path);
    rmdir(accounting_dir);
    printf("%s\n", ok ? "every scenario passed" : "some scenarios FAILED");
    return ok ? 0 : 1;
}
