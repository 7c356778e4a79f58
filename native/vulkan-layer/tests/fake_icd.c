/* A fake Vulkan driver (ICD) for the harness: GPUs that exist only in its memory, with the heaps, budgets, PCI bus
 * addresses and ids its environment gives them. The real Vulkan loader loads it from a manifest (VK_DRIVER_FILES,
 * VK_ICD_FILENAMES) under the layer, as it loads lavapipe, so that make check reaches what lavapipe cannot provoke:
 * a discrete GPU's device-local and host heaps, a driver with VK_EXT_memory_budget of its own, several GPUs told
 * apart by PCI bus address or UUID. Built for make check only: not installed, not in the wheel.
 *
 *   FAKE_ICD_GPUS=N              how many GPUs (1 to FAKE_ICD_MAX_GPUS; default 1)
 *   FAKE_ICD_TYPE=T              discrete, integrated, virtual or cpu, for every GPU (default discrete)
 *   FAKE_ICD_HEAPS=K:SIZE,...    each GPU's heaps, and one memory type per heap: type i is on heap i
 *                                (default device:8G,host:16G). K is device (device-local), bar (device-local and
 *                                host-visible: a resizable BAR) or host (host-visible, not device-local); SIZE is
 *                                bytes, or a number with K, M, G or T
 *   FAKE_ICD_BUDGET=1            VK_EXT_memory_budget, the driver's own: each heap's budget is its size less
 *                                FAKE_ICD_ELSEWHERE (what other processes are taken to hold, default 0), and its
 *                                usage what this process holds of it through the driver
 *   FAKE_ICD_PCI=ADDRESS,...     VK_EXT_pci_bus_info: GPU i is at the i-th DDDD:BB:DD.F (one per GPU)
 *   FAKE_ICD_VENDOR, FAKE_ICD_DEVICE   vendorID and deviceID (default 0x1002 and 0x73bf; decimal or 0x hex)
 *
 * GPU i's deviceUUID is fake_icd_uuid(i) (fake_icd.h) and its name "gpuppetti fake GPU i". Memory is counted, never
 * allocated: vkAllocateMemory succeeds while its heap has room, and then fails as a driver does, with
 * VK_ERROR_OUT_OF_DEVICE_MEMORY on a device-local heap and VK_ERROR_OUT_OF_HOST_MEMORY on a host heap.
 * fake_icd_stats says what reached the driver. A configuration that does not parse fails vkCreateInstance and says
 * why on stderr: a test with a typo in it fails instead of testing something else.
 *
 * It implements what the loader and the layer call, and no more: instance and device creation, physical devices
 * and their groups, properties and memory properties (and their 2 forms, with the chains the layer reads), device
 * extensions, vkAllocateMemory and vkFreeMemory, and the rest of Vulkan 1.0's physical-device calls, which the
 * loader requires of a driver (answered as by a device with no features and no formats). No queues are handed out,
 * so no submits: the compute share is lavapipe's to test.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vulkan/vk_icd.h>
#include <vulkan/vulkan.h>

#include "fake_icd.h"

#define EXPORT __attribute__((visibility("default")))
#define API_VERSION VK_MAKE_API_VERSION(0, 1, 3, VK_HEADER_VERSION)

/* -- the configuration, read once per process --------------------------------------------------------------- */

enum heap_kind { HEAP_DEVICE, HEAP_BAR, HEAP_HOST };

struct config {
    bool ok;
    char why[256];
    uint32_t gpus;
    VkPhysicalDeviceType type;
    uint32_t heap_count;
    enum heap_kind kinds[FAKE_ICD_MAX_HEAPS];
    VkDeviceSize sizes[FAKE_ICD_MAX_HEAPS];
    bool budget;
    VkDeviceSize elsewhere;
    bool pci;
    VkPhysicalDevicePCIBusInfoPropertiesEXT addresses[FAKE_ICD_MAX_GPUS];
    uint32_t vendor, device;
    bool reuse; /* a freed handle is the next one handed out, as drivers do */
};

static struct config config;
static pthread_once_t configured = PTHREAD_ONCE_INIT;

static bool fail(const char *name, const char *value)
{
    snprintf(config.why, sizeof config.why, "%s=%.120s does not parse", name, value);
    return false;
}

static bool parse_size(const char *text, size_t length, VkDeviceSize *out)
{
    char number[32];
    if (length == 0 || length >= sizeof number) return false;
    memcpy(number, text, length);
    number[length] = '\0';
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(number, &end, 10);
    if (errno != 0 || end == number || number[0] == '-') return false;
    int shift = 0;
    if (*end != '\0') {
        const char *units = "KMGT";
        const char *unit = strchr(units, *end);
        if (unit == NULL || end[1] != '\0') return false;
        shift = 10 * (int)(unit - units + 1);
    }
    if (value > (UINT64_MAX >> shift)) return false;
    *out = (VkDeviceSize)value << shift;
    return true;
}

static bool parse_number(const char *text, uint32_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long value = strtoul(text, &end, 0);
    if (errno != 0 || end == text || *end != '\0' || value > UINT32_MAX) return false;
    *out = (uint32_t)value;
    return true;
}

static bool parse_heaps(const char *text)
{
    const char *cursor = text;
    config.heap_count = 0;
    while (*cursor != '\0') {
        const char *comma = strchr(cursor, ',');
        size_t length = comma != NULL ? (size_t)(comma - cursor) : strlen(cursor);
        const char *colon = memchr(cursor, ':', length);
        if (colon == NULL || config.heap_count >= FAKE_ICD_MAX_HEAPS) return false;
        size_t kind_length = (size_t)(colon - cursor);
        enum heap_kind kind;
        if (kind_length == 6 && memcmp(cursor, "device", 6) == 0) kind = HEAP_DEVICE;
        else if (kind_length == 3 && memcmp(cursor, "bar", 3) == 0) kind = HEAP_BAR;
        else if (kind_length == 4 && memcmp(cursor, "host", 4) == 0) kind = HEAP_HOST;
        else return false;
        VkDeviceSize size;
        if (!parse_size(colon + 1, length - kind_length - 1, &size) || size == 0) return false;
        config.kinds[config.heap_count] = kind;
        config.sizes[config.heap_count] = size;
        config.heap_count++;
        cursor += length;
        if (*cursor == ',') {
            cursor++;
            if (*cursor == '\0') return false;
        }
    }
    return config.heap_count > 0;
}

static bool parse_addresses(const char *text)
{
    const char *cursor = text;
    uint32_t count = 0;
    while (*cursor != '\0') {
        const char *comma = strchr(cursor, ',');
        size_t length = comma != NULL ? (size_t)(comma - cursor) : strlen(cursor);
        char address[32];
        if (length == 0 || length >= sizeof address || count >= FAKE_ICD_MAX_GPUS) return false;
        memcpy(address, cursor, length);
        address[length] = '\0';
        unsigned domain, bus, device, function;
        char tail;
        if (sscanf(address, "%x:%x:%x.%x%c", &domain, &bus, &device, &function, &tail) != 4) return false;
        config.addresses[count] = (VkPhysicalDevicePCIBusInfoPropertiesEXT){
            .pciDomain = domain, .pciBus = bus, .pciDevice = device, .pciFunction = function};
        count++;
        cursor += length;
        if (*cursor == ',') cursor++;
    }
    return count == config.gpus;
}

static bool parse_config(void)
{
    const char *value = getenv("FAKE_ICD_GPUS");
    config.gpus = 1;
    if (value != NULL && (!parse_number(value, &config.gpus) || config.gpus < 1 || config.gpus > FAKE_ICD_MAX_GPUS)) {
        return fail("FAKE_ICD_GPUS", value);
    }
    value = getenv("FAKE_ICD_TYPE");
    config.type = VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU;
    if (value != NULL) {
        if (strcmp(value, "discrete") == 0) config.type = VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU;
        else if (strcmp(value, "integrated") == 0) config.type = VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU;
        else if (strcmp(value, "virtual") == 0) config.type = VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU;
        else if (strcmp(value, "cpu") == 0) config.type = VK_PHYSICAL_DEVICE_TYPE_CPU;
        else return fail("FAKE_ICD_TYPE", value);
    }
    value = getenv("FAKE_ICD_HEAPS");
    if (value == NULL) {
        value = "device:8G,host:16G";
    }
    if (!parse_heaps(value)) {
        return fail("FAKE_ICD_HEAPS", value);
    }
    value = getenv("FAKE_ICD_BUDGET");
    if (value != NULL && strcmp(value, "1") != 0 && strcmp(value, "0") != 0) {
        return fail("FAKE_ICD_BUDGET", value);
    }
    config.budget = value != NULL && strcmp(value, "1") == 0;
    value = getenv("FAKE_ICD_ELSEWHERE");
    if (value != NULL && !parse_size(value, strlen(value), &config.elsewhere)) {
        return fail("FAKE_ICD_ELSEWHERE", value);
    }
    value = getenv("FAKE_ICD_PCI");
    config.pci = value != NULL;
    if (value != NULL && !parse_addresses(value)) {
        return fail("FAKE_ICD_PCI", value);
    }
    value = getenv("FAKE_ICD_VENDOR");
    config.vendor = 0x1002;
    if (value != NULL && !parse_number(value, &config.vendor)) {
        return fail("FAKE_ICD_VENDOR", value);
    }
    value = getenv("FAKE_ICD_REUSE");
    if (value != NULL && strcmp(value, "1") != 0 && strcmp(value, "0") != 0) {
        return fail("FAKE_ICD_REUSE", value);
    }
    config.reuse = value != NULL && strcmp(value, "1") == 0;
    value = getenv("FAKE_ICD_DEVICE");
    config.device = 0x73bf;
    if (value != NULL && !parse_number(value, &config.device)) {
        return fail("FAKE_ICD_DEVICE", value);
    }
    return true;
}

static void configure(void)
{
    config.ok = parse_config();
    if (!config.ok) {
        fprintf(stderr, "fake Vulkan driver: %s\n", config.why);
    }
}

static const struct config *get_config(void)
{
    pthread_once(&configured, configure);
    return &config;
}

/* -- what reached the driver ---------------------------------------------------------------------------------- */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_icd_stats stats[FAKE_ICD_MAX_GPUS];

/* With FAKE_ICD_REUSE=1: the last handle freed, handed out again next; and what runs once, in the next vkFreeMemory,
 * right after the handle is freed (as another thread's allocation can). */
static struct fake_memory *recycled;
static fake_icd_hook after_free;

EXPORT void fake_icd_after_free(fake_icd_hook hook)
{
    pthread_mutex_lock(&lock);
    after_free = hook;
    pthread_mutex_unlock(&lock);
}

EXPORT bool fake_icd_stats(uint32_t gpu, struct fake_icd_stats *out)
{
    const struct config *settings = get_config();
    if (!settings->ok || gpu >= settings->gpus) {
        return false;
    }
    pthread_mutex_lock(&lock);
    *out = stats[gpu];
    pthread_mutex_unlock(&lock);
    return true;
}

static void bad_call(uint32_t gpu)
{
    pthread_mutex_lock(&lock);
    stats[gpu].bad_calls++;
    pthread_mutex_unlock(&lock);
}

/* -- dispatchable objects: each begins with the loader's word ------------------------------------------------- */

struct fake_physical {
    VK_LOADER_DATA loader;
    uint32_t gpu;
};

struct fake_instance {
    VK_LOADER_DATA loader;
    uint32_t count;
    struct fake_physical gpus[FAKE_ICD_MAX_GPUS];
};

struct fake_memory {
    struct fake_memory *next;
    uint32_t heap;
    VkDeviceSize size;
};

struct fake_device {
    VK_LOADER_DATA loader;
    uint32_t gpu;
    struct fake_memory *memory; /* what it holds, under the lock */
};

static uint32_t gpu_of(VkPhysicalDevice handle)
{
    return ((const struct fake_physical *)handle)->gpu;
}

/* The usual two-call enumeration: how many there are, or as many as fit and VK_INCOMPLETE. */
static VkResult enumerate(uint32_t available, uint32_t *count, void *out, const void *items, size_t size)
{
    if (out == NULL) {
        *count = available;
        return VK_SUCCESS;
    }
    uint32_t written = *count < available ? *count : available;
    if (written > 0) {
        memcpy(out, items, written * size);
    }
    *count = written;
    return written < available ? VK_INCOMPLETE : VK_SUCCESS;
}

/* -- the instance --------------------------------------------------------------------------------------------- */

static VKAPI_ATTR VkResult VKAPI_CALL fake_EnumerateInstanceExtensionProperties(const char *layer, uint32_t *count,
                                                                                VkExtensionProperties *out)
{
    (void)out;
    if (layer != NULL) {
        return VK_ERROR_LAYER_NOT_PRESENT;
    }
    *count = 0;
    return VK_SUCCESS;
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_EnumerateInstanceVersion(uint32_t *version)
{
    *version = API_VERSION;
    return VK_SUCCESS;
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_CreateInstance(const VkInstanceCreateInfo *info,
                                                          const VkAllocationCallbacks *allocator, VkInstance *out)
{
    (void)allocator;
    const struct config *settings = get_config();
    if (!settings->ok) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    if (info->enabledExtensionCount > 0) {
        return VK_ERROR_EXTENSION_NOT_PRESENT; /* it offers none */
    }
    struct fake_instance *instance = calloc(1, sizeof *instance);
    if (instance == NULL) {
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    set_loader_magic_value(instance);
    instance->count = settings->gpus;
    for (uint32_t i = 0; i < settings->gpus; i++) {
        set_loader_magic_value(&instance->gpus[i]);
        instance->gpus[i].gpu = i;
    }
    *out = (VkInstance)instance;
    return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL fake_DestroyInstance(VkInstance handle, const VkAllocationCallbacks *allocator)
{
    (void)allocator;
    free((struct fake_instance *)handle);
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_EnumeratePhysicalDevices(VkInstance handle, uint32_t *count,
                                                                    VkPhysicalDevice *out)
{
    struct fake_instance *instance = (struct fake_instance *)handle;
    VkPhysicalDevice handles[FAKE_ICD_MAX_GPUS];
    for (uint32_t i = 0; i < instance->count; i++) {
        handles[i] = (VkPhysicalDevice)&instance->gpus[i];
    }
    return enumerate(instance->count, count, out, handles, sizeof *handles);
}

/* Each GPU a group of its own, as on a machine without linked GPUs. */
static VKAPI_ATTR VkResult VKAPI_CALL fake_EnumeratePhysicalDeviceGroups(VkInstance handle, uint32_t *count,
                                                                         VkPhysicalDeviceGroupProperties *out)
{
    struct fake_instance *instance = (struct fake_instance *)handle;
    if (out == NULL) {
        *count = instance->count;
        return VK_SUCCESS;
    }
    uint32_t written = *count < instance->count ? *count : instance->count;
    for (uint32_t i = 0; i < written; i++) {
        out[i].physicalDeviceCount = 1;
        memset(out[i].physicalDevices, 0, sizeof out[i].physicalDevices);
        out[i].physicalDevices[0] = (VkPhysicalDevice)&instance->gpus[i];
        out[i].subsetAllocation = VK_FALSE;
    }
    *count = written;
    return written < instance->count ? VK_INCOMPLETE : VK_SUCCESS;
}

/* -- a physical device ---------------------------------------------------------------------------------------- */

static VkDeviceSize largest_heap(void)
{
    VkDeviceSize largest = 0;
    for (uint32_t heap = 0; heap < config.heap_count; heap++) {
        largest = config.sizes[heap] > largest ? config.sizes[heap] : largest;
    }
    return largest;
}

static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceProperties(VkPhysicalDevice handle,
                                                                   VkPhysicalDeviceProperties *out)
{
    uint32_t gpu = gpu_of(handle);
    memset(out, 0, sizeof *out);
    out->apiVersion = API_VERSION;
    out->driverVersion = VK_MAKE_API_VERSION(0, 1, 0, 0);
    out->vendorID = config.vendor;
    out->deviceID = config.device;
    out->deviceType = config.type;
    snprintf(out->deviceName, sizeof out->deviceName, "gpuppetti fake GPU %u", gpu);
    fake_icd_uuid(gpu, out->pipelineCacheUUID);
    out->limits.maxMemoryAllocationCount = 4096;
    out->limits.bufferImageGranularity = 1;
    out->limits.minMemoryMapAlignment = 64;
    out->limits.nonCoherentAtomSize = 64;
    out->limits.maxStorageBufferRange = UINT32_MAX;
}

/* The structures of the chain it knows; any other is left alone, as a driver leaves what it does not know. */
static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceProperties2(VkPhysicalDevice handle,
                                                                    VkPhysicalDeviceProperties2 *out)
{
    uint32_t gpu = gpu_of(handle);
    fake_GetPhysicalDeviceProperties(handle, &out->properties);
    uint8_t uuid[VK_UUID_SIZE], driver[VK_UUID_SIZE];
    fake_icd_uuid(gpu, uuid);
    memset(driver, 0x77, sizeof driver);
    for (VkBaseOutStructure *next = out->pNext; next != NULL; next = next->pNext) {
        switch ((int)next->sType) {
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES: {
            VkPhysicalDeviceIDProperties *id = (VkPhysicalDeviceIDProperties *)next;
            memcpy(id->deviceUUID, uuid, VK_UUID_SIZE);
            memcpy(id->driverUUID, driver, VK_UUID_SIZE);
            memset(id->deviceLUID, 0, VK_LUID_SIZE);
            id->deviceNodeMask = 0;
            id->deviceLUIDValid = VK_FALSE;
            break;
        }
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES: {
            VkPhysicalDeviceVulkan11Properties *p = (VkPhysicalDeviceVulkan11Properties *)next;
            memcpy(p->deviceUUID, uuid, VK_UUID_SIZE);
            memcpy(p->driverUUID, driver, VK_UUID_SIZE);
            p->maxMemoryAllocationSize = largest_heap();
            p->maxPerSetDescriptors = 1024;
            break;
        }
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES: {
            VkPhysicalDeviceMaintenance3Properties *p = (VkPhysicalDeviceMaintenance3Properties *)next;
            p->maxMemoryAllocationSize = largest_heap();
            p->maxPerSetDescriptors = 1024;
            break;
        }
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES:
            ((VkPhysicalDeviceMaintenance4Properties *)next)->maxBufferSize = largest_heap();
            break;
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_PROPERTIES:
            ((VkPhysicalDeviceVulkan13Properties *)next)->maxBufferSize = largest_heap();
            break;
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT:
            if (config.pci) {
                VkPhysicalDevicePCIBusInfoPropertiesEXT *pci = (VkPhysicalDevicePCIBusInfoPropertiesEXT *)next;
                pci->pciDomain = config.addresses[gpu].pciDomain;
                pci->pciBus = config.addresses[gpu].pciBus;
                pci->pciDevice = config.addresses[gpu].pciDevice;
                pci->pciFunction = config.addresses[gpu].pciFunction;
            }
            break;
        default:
            break;
        }
    }
}

static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceMemoryProperties(VkPhysicalDevice handle,
                                                                         VkPhysicalDeviceMemoryProperties *out)
{
    (void)handle;
    memset(out, 0, sizeof *out);
    out->memoryHeapCount = config.heap_count;
    out->memoryTypeCount = config.heap_count;
    for (uint32_t heap = 0; heap < config.heap_count; heap++) {
        out->memoryHeaps[heap].size = config.sizes[heap];
        VkMemoryPropertyFlags host = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
        switch (config.kinds[heap]) {
        case HEAP_DEVICE:
            out->memoryHeaps[heap].flags = VK_MEMORY_HEAP_DEVICE_LOCAL_BIT;
            out->memoryTypes[heap].propertyFlags = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT;
            break;
        case HEAP_BAR:
            out->memoryHeaps[heap].flags = VK_MEMORY_HEAP_DEVICE_LOCAL_BIT;
            out->memoryTypes[heap].propertyFlags = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | host;
            break;
        case HEAP_HOST:
            out->memoryHeaps[heap].flags = 0;
            out->memoryTypes[heap].propertyFlags = host | VK_MEMORY_PROPERTY_HOST_CACHED_BIT;
            break;
        }
        out->memoryTypes[heap].heapIndex = heap;
    }
}

static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceMemoryProperties2(VkPhysicalDevice handle,
                                                                          VkPhysicalDeviceMemoryProperties2 *out)
{
    uint32_t gpu = gpu_of(handle);
    fake_GetPhysicalDeviceMemoryProperties(handle, &out->memoryProperties);
    if (!config.budget) {
        return; /* without the extension, its structure is one the driver does not know */
    }
    for (VkBaseOutStructure *next = out->pNext; next != NULL; next = next->pNext) {
        if (next->sType != VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT) {
            continue;
        }
        VkPhysicalDeviceMemoryBudgetPropertiesEXT *budget = (VkPhysicalDeviceMemoryBudgetPropertiesEXT *)next;
        pthread_mutex_lock(&lock);
        for (uint32_t heap = 0; heap < VK_MAX_MEMORY_HEAPS; heap++) {
            bool exists = heap < config.heap_count;
            VkDeviceSize size = exists ? config.sizes[heap] : 0;
            budget->heapBudget[heap] = size > config.elsewhere ? size - config.elsewhere : 0;
            budget->heapUsage[heap] = exists ? stats[gpu].in_use[heap] : 0;
        }
        pthread_mutex_unlock(&lock);
    }
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_EnumerateDeviceExtensionProperties(VkPhysicalDevice handle,
                                                                              const char *layer, uint32_t *count,
                                                                              VkExtensionProperties *out)
{
    (void)handle;
    if (layer != NULL) {
        return VK_ERROR_LAYER_NOT_PRESENT;
    }
    VkExtensionProperties offered[2];
    uint32_t available = 0;
    if (config.pci) {
        offered[available++] = (VkExtensionProperties){VK_EXT_PCI_BUS_INFO_EXTENSION_NAME,
                                                       VK_EXT_PCI_BUS_INFO_SPEC_VERSION};
    }
    if (config.budget) {
        offered[available++] = (VkExtensionProperties){VK_EXT_MEMORY_BUDGET_EXTENSION_NAME,
                                                       VK_EXT_MEMORY_BUDGET_SPEC_VERSION};
    }
    return enumerate(available, count, out, offered, sizeof *offered);
}

/* The rest of Vulkan 1.0's physical-device calls: the loader gives up on a driver that lacks any of them. One queue
 * family with one queue, no features, no formats. */
static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceFeatures(VkPhysicalDevice handle,
                                                                 VkPhysicalDeviceFeatures *out)
{
    (void)handle;
    memset(out, 0, sizeof *out);
}

static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceFormatProperties(VkPhysicalDevice handle, VkFormat format,
                                                                         VkFormatProperties *out)
{
    (void)handle;
    (void)format;
    memset(out, 0, sizeof *out);
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_GetPhysicalDeviceImageFormatProperties(
    VkPhysicalDevice handle, VkFormat format, VkImageType type, VkImageTiling tiling, VkImageUsageFlags usage,
    VkImageCreateFlags flags, VkImageFormatProperties *out)
{
    (void)handle;
    (void)format;
    (void)type;
    (void)tiling;
    (void)usage;
    (void)flags;
    memset(out, 0, sizeof *out);
    return VK_ERROR_FORMAT_NOT_SUPPORTED;
}

static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceSparseImageFormatProperties(
    VkPhysicalDevice handle, VkFormat format, VkImageType type, VkSampleCountFlagBits samples,
    VkImageUsageFlags usage, VkImageTiling tiling, uint32_t *count, VkSparseImageFormatProperties *out)
{
    (void)handle;
    (void)format;
    (void)type;
    (void)samples;
    (void)usage;
    (void)tiling;
    (void)out;
    *count = 0;
}

static VKAPI_ATTR void VKAPI_CALL fake_GetPhysicalDeviceQueueFamilyProperties(VkPhysicalDevice handle,
                                                                              uint32_t *count,
                                                                              VkQueueFamilyProperties *out)
{
    (void)handle;
    VkQueueFamilyProperties family = {.queueFlags = VK_QUEUE_COMPUTE_BIT | VK_QUEUE_TRANSFER_BIT, .queueCount = 1};
    enumerate(1, count, out, &family, sizeof family);
}

/* -- a device ------------------------------------------------------------------------------------------------- */

static bool offers(const char *name)
{
    return (config.pci && strcmp(name, VK_EXT_PCI_BUS_INFO_EXTENSION_NAME) == 0) ||
           (config.budget && strcmp(name, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME) == 0);
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_CreateDevice(VkPhysicalDevice physical, const VkDeviceCreateInfo *info,
                                                        const VkAllocationCallbacks *allocator, VkDevice *out)
{
    (void)allocator;
    uint32_t gpu = gpu_of(physical);
    bool budget = false;
    for (uint32_t i = 0; i < info->enabledExtensionCount; i++) {
        if (!offers(info->ppEnabledExtensionNames[i])) {
            bad_call(gpu);
            return VK_ERROR_EXTENSION_NOT_PRESENT;
        }
        budget |= strcmp(info->ppEnabledExtensionNames[i], VK_EXT_MEMORY_BUDGET_EXTENSION_NAME) == 0;
    }
    /* One queue family, with one queue. */
    for (uint32_t i = 0; i < info->queueCreateInfoCount; i++) {
        if (info->pQueueCreateInfos[i].queueFamilyIndex != 0 || info->pQueueCreateInfos[i].queueCount != 1) {
            bad_call(gpu);
            return VK_ERROR_INITIALIZATION_FAILED;
        }
    }
    struct fake_device *device = calloc(1, sizeof *device);
    if (device == NULL) {
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    set_loader_magic_value(device);
    device->gpu = gpu;
    pthread_mutex_lock(&lock);
    stats[gpu].devices++;
    stats[gpu].budget_enabled += budget;
    pthread_mutex_unlock(&lock);
    *out = (VkDevice)device;
    return VK_SUCCESS;
}

/* What a device still held when it is destroyed goes with it, as a driver frees it. */
static VKAPI_ATTR void VKAPI_CALL fake_DestroyDevice(VkDevice handle, const VkAllocationCallbacks *allocator)
{
    (void)allocator;
    struct fake_device *device = (struct fake_device *)handle;
    if (device == NULL) {
        return;
    }
    pthread_mutex_lock(&lock);
    while (device->memory != NULL) {
        struct fake_memory *memory = device->memory;
        device->memory = memory->next;
        stats[device->gpu].in_use[memory->heap] -= memory->size;
        free(memory);
    }
    pthread_mutex_unlock(&lock);
    free(device);
}

static VKAPI_ATTR VkResult VKAPI_CALL fake_AllocateMemory(VkDevice handle, const VkMemoryAllocateInfo *info,
                                                          const VkAllocationCallbacks *allocator,
                                                          VkDeviceMemory *out)
{
    (void)allocator;
    struct fake_device *device = (struct fake_device *)handle;
    struct fake_icd_stats *gpu = &stats[device->gpu];
    if (info == NULL || info->sType != VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO ||
        info->memoryTypeIndex >= config.heap_count || info->allocationSize == 0) {
        bad_call(device->gpu);
        return VK_ERROR_UNKNOWN;
    }
    uint32_t heap = info->memoryTypeIndex; /* type i is on heap i */
    pthread_mutex_lock(&lock);
    struct fake_memory *memory = recycled;
    recycled = NULL;
    pthread_mutex_unlock(&lock);
    if (memory == NULL) {
        memory = malloc(sizeof *memory);
    }
    if (memory == NULL) {
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    pthread_mutex_lock(&lock);
    gpu->allocations++;
    if (info->allocationSize > config.sizes[heap] - gpu->in_use[heap]) {
        gpu->refusals++;
        pthread_mutex_unlock(&lock);
        free(memory);
        return config.kinds[heap] == HEAP_HOST ? VK_ERROR_OUT_OF_HOST_MEMORY : VK_ERROR_OUT_OF_DEVICE_MEMORY;
    }
    gpu->in_use[heap] += info->allocationSize;
    memory->heap = heap;
    memory->size = info->allocationSize;
    memory->next = device->memory;
    device->memory = memory;
    pthread_mutex_unlock(&lock);
    *out = (VkDeviceMemory)(void *)memory;
    return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL fake_FreeMemory(VkDevice handle, VkDeviceMemory memory,
                                                  const VkAllocationCallbacks *allocator)
{
    (void)allocator;
    struct fake_device *device = (struct fake_device *)handle;
    if (memory == VK_NULL_HANDLE) {
        return;
    }
    /* Only memory this device handed out and has not taken back: anything else is the caller's mistake. */
    struct fake_memory *found = NULL;
    pthread_mutex_lock(&lock);
    for (struct fake_memory **link = &device->memory; *link != NULL; link = &(*link)->next) {
        if ((void *)*link == (void *)memory) {
            found = *link;
            *link = found->next;
            stats[device->gpu].in_use[found->heap] -= found->size;
            break;
        }
    }
    if (found == NULL) {
        stats[device->gpu].bad_calls++;
    }
    if (found != NULL && config.reuse && recycled == NULL) {
        recycled = found;
        found = NULL;
    }
    fake_icd_hook hook = after_free;
    after_free = NULL;
    pthread_mutex_unlock(&lock);
    free(found);
    if (hook != NULL) {
        hook();
    }
}

/* -- the entry points ----------------------------------------------------------------------------------------- */

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL fake_GetDeviceProcAddr(VkDevice handle, const char *name);

struct entry {
    const char *name;
    PFN_vkVoidFunction function;
};

#define ENTRY(name, function) {name, (PFN_vkVoidFunction)function}

/* What needs no instance. */
static const struct entry global_entries[] = {
    ENTRY("vkCreateInstance", fake_CreateInstance),
    ENTRY("vkEnumerateInstanceExtensionProperties", fake_EnumerateInstanceExtensionProperties),
    ENTRY("vkEnumerateInstanceVersion", fake_EnumerateInstanceVersion),
};

/* What takes a physical device (vk_icdGetPhysicalDeviceProcAddr answers for these). */
static const struct entry physical_entries[] = {
    ENTRY("vkGetPhysicalDeviceProperties", fake_GetPhysicalDeviceProperties),
    ENTRY("vkGetPhysicalDeviceProperties2", fake_GetPhysicalDeviceProperties2),
    ENTRY("vkGetPhysicalDeviceProperties2KHR", fake_GetPhysicalDeviceProperties2),
    ENTRY("vkGetPhysicalDeviceMemoryProperties", fake_GetPhysicalDeviceMemoryProperties),
    ENTRY("vkGetPhysicalDeviceMemoryProperties2", fake_GetPhysicalDeviceMemoryProperties2),
    ENTRY("vkGetPhysicalDeviceMemoryProperties2KHR", fake_GetPhysicalDeviceMemoryProperties2),
    ENTRY("vkEnumerateDeviceExtensionProperties", fake_EnumerateDeviceExtensionProperties),
    ENTRY("vkCreateDevice", fake_CreateDevice),
    ENTRY("vkGetPhysicalDeviceFeatures", fake_GetPhysicalDeviceFeatures),
    ENTRY("vkGetPhysicalDeviceFormatProperties", fake_GetPhysicalDeviceFormatProperties),
    ENTRY("vkGetPhysicalDeviceImageFormatProperties", fake_GetPhysicalDeviceImageFormatProperties),
    ENTRY("vkGetPhysicalDeviceSparseImageFormatProperties", fake_GetPhysicalDeviceSparseImageFormatProperties),
    ENTRY("vkGetPhysicalDeviceQueueFamilyProperties", fake_GetPhysicalDeviceQueueFamilyProperties),
};

static const struct entry instance_entries[] = {
    ENTRY("vkDestroyInstance", fake_DestroyInstance),
    ENTRY("vkEnumeratePhysicalDevices", fake_EnumeratePhysicalDevices),
    ENTRY("vkEnumeratePhysicalDeviceGroups", fake_EnumeratePhysicalDeviceGroups),
    ENTRY("vkEnumeratePhysicalDeviceGroupsKHR", fake_EnumeratePhysicalDeviceGroups),
    ENTRY("vkGetDeviceProcAddr", fake_GetDeviceProcAddr),
};

static const struct entry device_entries[] = {
    ENTRY("vkGetDeviceProcAddr", fake_GetDeviceProcAddr),
    ENTRY("vkDestroyDevice", fake_DestroyDevice),
    ENTRY("vkAllocateMemory", fake_AllocateMemory),
    ENTRY("vkFreeMemory", fake_FreeMemory),
};

#undef ENTRY

static PFN_vkVoidFunction find(const struct entry *entries, size_t count, const char *name)
{
    for (size_t i = 0; i < count; i++) {
        if (strcmp(entries[i].name, name) == 0) {
            return entries[i].function;
        }
    }
    return NULL;
}

#define FIND(entries, name) find(entries, sizeof entries / sizeof *entries, name)

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL fake_GetDeviceProcAddr(VkDevice handle, const char *name)
{
    (void)handle;
    return FIND(device_entries, name);
}

EXPORT VKAPI_ATTR VkResult VKAPI_CALL vk_icdNegotiateLoaderICDInterfaceVersion(uint32_t *version)
{
    /* 5: the loader passes the application's API version through; 6 and 7 add nothing used here. */
    if (*version < 5) {
        return VK_ERROR_INCOMPATIBLE_DRIVER;
    }
    *version = 5;
    return VK_SUCCESS;
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vk_icdGetPhysicalDeviceProcAddr(VkInstance instance,
                                                                                const char *name)
{
    (void)instance;
    return FIND(physical_entries, name);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vk_icdGetInstanceProcAddr(VkInstance instance, const char *name)
{
    PFN_vkVoidFunction function = FIND(global_entries, name);
    if (function != NULL || instance == VK_NULL_HANDLE) {
        return function;
    }
    function = FIND(instance_entries, name);
    if (function == NULL) {
        function = FIND(physical_entries, name);
    }
    if (function == NULL) {
        function = FIND(device_entries, name);
    }
    return function;
}
